/* core/fs's temporary-path registry (fl_fs_tmp_track): what a stop by a signal removes before the process dies
 * (src/cli/signals.c); the CLI cases convert_ctrl_c, merge_lora_sigterm and ctrl_c_twice_in_save check it end to end.
 * fl_fs_write_file_atomic over links, pipes and devices. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

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

/* The files a command writes to a path the user named (loss --dump-logits, image-info --dump): a regular file is
 * replaced through path.tmp; a symlink's target is replaced, the link kept; a FIFO and a device are written in place,
 * never replaced by a file (as root a rename onto /dev/full or /dev/null succeeds); a folder is an error naming it */
FL_TEST(fs_write_atomic_keeps_links_devices_and_pipes) {
    char td[500], real[600], link[600], fifo[600], dir[600], dev[600], dangling[600], made[600];
    snprintf(td, sizeof td, "%s", fl_test_tmpdir());
    snprintf(real, sizeof real, "%s/real.f32", td);
    snprintf(link, sizeof link, "%s/link.f32", td);
    snprintf(fifo, sizeof fifo, "%s/pipe.f32", td);
    snprintf(dir, sizeof dir, "%s/folder", td);
    snprintf(dangling, sizeof dangling, "%s/dangling.f32", td);
    snprintf(made, sizeof made, "%s/made.f32", td);
    FL_REQUIRE_OK(fl_fs_write_file_atomic(real, "old", 3));
    FL_REQUIRE(symlink("real.f32", link) == 0 && mkfifo(fifo, 0644) == 0 && mkdir(dir, 0755) == 0);
    struct stat st;
    FL_REQUIRE_OK(fl_fs_write_file_atomic(link, "abcdef", 6));
    FL_CHECKF(lstat(link, &st) == 0 && S_ISLNK(st.st_mode), "the link was replaced by a file");
    FL_CHECKF(stat(real, &st) == 0 && st.st_size == 6, "the link's target holds %lld bytes (want 6)", (long long)st.st_size);
    FL_REQUIRE(symlink("made.f32", dangling) == 0); /* a dangling link: its target made */
    FL_REQUIRE_OK(fl_fs_write_file_atomic(dangling, "ab", 2));
    FL_CHECKF(lstat(dangling, &st) == 0 && S_ISLNK(st.st_mode) && stat(made, &st) == 0 && st.st_size == 2,
              "a dangling link: its target not made");
    /* the FIFO's reader opened first (non-blocking: the writer's open then finds it); 10 bytes fit the pipe's buffer */
    const int rd = open(fifo, O_RDONLY | O_NONBLOCK);
    FL_REQUIRE(rd >= 0);
    const fl_status s = fl_fs_write_file_atomic(fifo, "0123456789", 10);
    char got[16];
    const ssize_t n = read(rd, got, sizeof got);
    close(rd);
    FL_CHECKF(s == FL_OK && n == 10, "FIFO: %s, the reader got %zd bytes (want 10)", fl_error_message(), n);
    FL_CHECKF(lstat(fifo, &st) == 0 && S_ISFIFO(st.st_mode), "the FIFO was replaced");
    FL_CHECK(fl_fs_write_file_atomic(dir, "x", 1) == FL_ERR_IO && strstr(fl_error_message(), "is a folder"));
    /* devices: nodes of /dev/null's and /dev/full's numbers made here (root only) */
    snprintf(dev, sizeof dev, "%s/null", td);
    if (mknod(dev, S_IFCHR | 0644, makedev(1, 3)) != 0) {
        printf("      device nodes not checked: mknod: %s (root only)\n", strerror(errno));
        return;
    }
    FL_CHECKF(fl_fs_write_file_atomic(dev, "x", 1) == FL_OK, "the null device: %s", fl_error_message());
    FL_CHECKF(lstat(dev, &st) == 0 && S_ISCHR(st.st_mode), "the null device was replaced by a file");
    snprintf(dev, sizeof dev, "%s/full", td);
    FL_REQUIRE(mknod(dev, S_IFCHR | 0644, makedev(1, 7)) == 0);
    FL_CHECKF(fl_fs_write_file_atomic(dev, "x", 1) == FL_ERR_IO && strstr(fl_error_message(), "No space left"),
              "the full device: %s", fl_error_message());
    FL_CHECKF(lstat(dev, &st) == 0 && S_ISCHR(st.st_mode), "the full device was replaced by a file");
}
