/* core/fs's temporary-path registry (fl_fs_tmp_track): what a stop by a signal removes before the process dies
 * (src/cli/signals.c); the CLI cases convert_ctrl_c, merge_lora_sigterm and ctrl_c_twice_in_save check it end to end. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "core/fs.h"
#include "test.h"

static int exists(const char *p) {
    struct stat st;
    return lstat(p, &st) == 0;
}

/* a tracked folder (with a subfolder and files) and a tracked file are removed, a tracked path that does not exist is
 * not counted, an untracked one is kept; after fl_fs_tmp_untrack nothing is removed any more */
FL_TEST(fs_tmp_tracked_paths_removed) {
    char dir[600], sub[700], f1[800], f2[700], keep[700], gone[700];
    snprintf(dir, sizeof dir, "%s/out.tmp-1", fl_test_tmpdir());
    snprintf(sub, sizeof sub, "%s/adapter", dir);
    snprintf(f1, sizeof f1, "%s/model.safetensors.tmp", sub);
    snprintf(f2, sizeof f2, "%s/config.json.tmp", fl_test_tmpdir());
    snprintf(keep, sizeof keep, "%s/keep.json", fl_test_tmpdir());
    snprintf(gone, sizeof gone, "%s/never-made", fl_test_tmpdir());
    FL_REQUIRE_OK(fl_fs_mkdir_p(sub));
    FL_REQUIRE_OK(fl_fs_write_file_atomic(f1, "x", 1));
    FL_REQUIRE_OK(fl_fs_write_file_atomic(f2, "y", 1));
    FL_REQUIRE_OK(fl_fs_write_file_atomic(keep, "z", 1));
    fl_fs_tmp_track(dir);
    fl_fs_tmp_track(f2);
    fl_fs_tmp_track(gone);
    const int n = fl_fs_tmp_remove_all();
    FL_CHECKF(n == 2 && !exists(dir) && !exists(f2) && exists(keep), "removed %d (want 2); folder %s, file %s, kept %s", n,
              exists(dir) ? "left" : "gone", exists(f2) ? "left" : "gone", exists(keep) ? "yes" : "no");
    fl_fs_tmp_untrack(dir);
    fl_fs_tmp_untrack(f2);
    fl_fs_tmp_untrack(gone);
    FL_REQUIRE_OK(fl_fs_write_file_atomic(f2, "y", 1)); /* tracked while it wrote, untracked after its rename */
    FL_CHECKF(fl_fs_tmp_remove_all() == 0 && exists(f2), "an untracked path was removed");
}

/* more paths than slots: the extra ones are not tracked (never an overflow), and untracking frees a slot */
FL_TEST(fs_tmp_track_slots_bounded) {
    char p[FL_FS_TMP_SLOTS + 2][600];
    for (int i = 0; i < FL_FS_TMP_SLOTS + 2; i++) {
        snprintf(p[i], sizeof p[i], "%s/t%d", fl_test_tmpdir(), i);
        FL_REQUIRE_OK(fl_fs_write_file_atomic(p[i], "x", 1));
        fl_fs_tmp_track(p[i]);
    }
    const int n = fl_fs_tmp_remove_all();
    FL_CHECKF(n == FL_FS_TMP_SLOTS && exists(p[FL_FS_TMP_SLOTS]) && exists(p[FL_FS_TMP_SLOTS + 1]),
              "removed %d of %d tracked (slots %d)", n, FL_FS_TMP_SLOTS + 2, FL_FS_TMP_SLOTS);
    for (int i = 0; i < FL_FS_TMP_SLOTS + 2; i++) fl_fs_tmp_untrack(p[i]);
    fl_fs_tmp_track(p[FL_FS_TMP_SLOTS]);
    FL_CHECKF(fl_fs_tmp_remove_all() == 1 && !exists(p[FL_FS_TMP_SLOTS]), "a freed slot was not reused");
    fl_fs_tmp_untrack(p[FL_FS_TMP_SLOTS]);
}
