/* Large copies with non-temporal (streaming) stores, the GIL released.
 *
 * Why: the bytes a transfer writes into a segment, or into a caller's buffer, are not read
 * again by this core soon. An ordinary memcpy pulls every destination line into the caches
 * first (a read for ownership) and so evicts what the process was working on: the client's
 * Python state, the inference engine's own data. glibc switches to streaming
 * stores only far above KV block sizes (240 MiB on the 2-core AMD host of the README's figures),
 * so this module does it for the large copies kvpool makes. On x86-64 (SSE2, which every x86-64 CPU
 * has) it streams 64 bytes per step and fences once at the end, so the bytes are globally
 * visible before the call returns (before the put is committed); elsewhere it is memcpy.
 *
 * copy(dst, src): dst a writable contiguous buffer, src a contiguous buffer of the same size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>

static void stream_copy(char *dst, const char *src, size_t n)
{
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    for (; n >= 64; n -= 64, dst += 64, src += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
    memcpy(dst, src, n);
}
#define STREAMING 1
#else
static void stream_copy(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }
#define STREAMING 0
#endif

static PyObject *ntcopy_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*:copy", &dst, &src))
        return NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy: destination holds %zd bytes, source %zd",
                     dst.len, src.len);
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    char *to = (char *)dst.buf;
    const char *from = (const char *)src.buf;
    size_t n = (size_t)dst.len;
    Py_BEGIN_ALLOW_THREADS
    if (to < from + n && from < to + n)
        memmove(to, from, n); /* overlapping ranges: never streamed */
    else
        stream_copy(to, from, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef ntcopy_methods[] = {
    {"copy", ntcopy_copy, METH_VARARGS,
     "copy(dst, src): copy src into dst (same size) with streaming stores, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ntcopy_module = {
    PyModuleDef_HEAD_INIT, "_ntcopy",
    "Large copies with non-temporal stores (see the source for why).", -1, ntcopy_methods,
};

PyMODINIT_FUNC PyInit__ntcopy(void)
{
    PyObject *module = PyModule_Create(&ntcopy_module);
    if (module != NULL && PyModule_AddIntConstant(module, "STREAMING", STREAMING) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
