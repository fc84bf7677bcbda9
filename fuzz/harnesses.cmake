# libFuzzer harnesses (included by CMakeLists.txt when FL_FUZZ=ON; fuzz/build.sh configures that build
# with clang). Every fuzz/fuzz_*.c is a harness: one binary named after the file, or one per
# "// fuzz-build: NAME [DEFINE...]" line in it (the same source built with different -D switches).
# They link the same `fitllm` library target as the CLI and the tests, so new library sources and
# libraries (src/**/*.c, the link libraries added to `fitllm`) follow without edits here.
# build-fuzz/harnesses.txt lists the binaries (fuzz/run_all.sh runs them all).
if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
  message(FATAL_ERROR "FL_FUZZ=ON needs clang with libFuzzer (CC=clang; apt-get install clang libclang-rt-dev libomp-dev)")
endif()
file(GLOB FL_FUZZ_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/fuzz/fuzz_*.c)
add_custom_target(fuzz_all)
set(FL_FUZZ_NAMES "")
foreach(src ${FL_FUZZ_SOURCES})
  get_filename_component(base ${src} NAME_WE)
  file(STRINGS ${src} variants REGEX "^// fuzz-build: ")
  if(NOT variants)
    set(variants "// fuzz-build: ${base}")
  endif()
  foreach(line ${variants})
    string(REGEX REPLACE "^// fuzz-build: *" "" spec "${line}")
    separate_arguments(spec UNIX_COMMAND "${spec}")
    list(GET spec 0 name)
    list(REMOVE_AT spec 0)
    add_executable(${name} ${src})
    target_compile_definitions(${name} PRIVATE ${spec})
    target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/src ${CMAKE_SOURCE_DIR}/fuzz)
    target_link_libraries(${name} PRIVATE fitllm)
    # the library and the harness are compiled with -fsanitize=fuzzer-no-link (coverage, in
    # CMAKE_C_FLAGS); linking with -fsanitize=fuzzer adds libFuzzer and its main()
    target_link_options(${name} PRIVATE -fsanitize=fuzzer)
    add_dependencies(fuzz_all ${name})
    list(APPEND FL_FUZZ_NAMES ${name})
  endforeach()
endforeach()
list(SORT FL_FUZZ_NAMES)
string(REPLACE ";" "\n" FL_FUZZ_LIST "${FL_FUZZ_NAMES}")
file(WRITE ${CMAKE_BINARY_DIR}/harnesses.txt "${FL_FUZZ_LIST}\n")
message(STATUS "fitllm fuzz harnesses: ${FL_FUZZ_NAMES}")
