/* A stand-in for cuDNN 9's libcudnn.so.9 (built as build/fake-cudnn/libcudnn.so.9 in every build; never
 * installed): tests/test_cudnn.c opens it by path to check what fitllm's loader (src/backend/cuda/
 * cudnn_load.c) says of a library too old or one that cannot make a handle, on machines without cuDNN.
 * Only the symbols the loader resolves, with cuDNN's values:
 *   FITLLM_FAKE_CUDNN_VERSION  what cudnnGetVersion reports (default 91900: 9.19.0)
 *   cudnnCreate fails with CUDNN_STATUS_NOT_INITIALIZED (1001), as the real one without a GPU. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

size_t cudnnGetVersion(void) {
    const char *e = getenv("FITLLM_FAKE_CUDNN_VERSION");
    return e && *e ? (size_t)atol(e) : 91900;
}
const char *cudnnGetErrorString(int s) { return s == 1001 ? "CUDNN_STATUS_NOT_INITIALIZED" : "CUDNN_STATUS_FAKE"; }
int cudnnCreate(void **h) { *h = NULL; return 1001; }
int cudnnDestroy(void *h) { (void)h; return 0; }
int cudnnSetStream(void *h, void *s) { (void)h, (void)s; return 0; }
int cudnnBackendCreateDescriptor(int t, void **d) { (void)t, *d = NULL; return 3000; }
int cudnnBackendDestroyDescriptor(void *d) { (void)d; return 0; }
int cudnnBackendSetAttribute(void *d, int n, int t, int64_t c, const void *v) { (void)d, (void)n, (void)t, (void)c, (void)v; return 3000; }
int cudnnBackendGetAttribute(void *d, int n, int t, int64_t r, int64_t *c, void *v) { (void)d, (void)n, (void)t, (void)r, (void)c, (void)v; return 3000; }
int cudnnBackendFinalize(void *d) { (void)d; return 3000; }
int cudnnBackendExecute(void *h, void *p, void *v) { (void)h, (void)p, (void)v; return 3000; }
