# Writes OUT (a C header defining FL_GIT_DESCRIBE) from `git describe` of SRC at BUILD time, so
# `fitllm --version` names the commit it was built from; the file is rewritten only when the
# text changes, so an unchanged tree rebuilds nothing.
set(desc "")
find_package(Git QUIET)
if(GIT_FOUND)
  execute_process(COMMAND ${GIT_EXECUTABLE} describe --always --dirty --tags
                  WORKING_DIRECTORY ${SRC} OUTPUT_VARIABLE desc
                  OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
endif()
set(text "#define FL_GIT_DESCRIBE \"${desc}\"\n")
set(old "")
if(EXISTS ${OUT})
  file(READ ${OUT} old)
endif()
if(NOT old STREQUAL text)
  file(WRITE ${OUT} "${text}")
endif()
