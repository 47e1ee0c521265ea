/* The slab mover's native data path: a job's blocks checksummed and written, or read and
 * checksummed, with the GIL released once per call instead of once per block and per run.
 *
 * Built at install time by hatch_build.py when a C compiler and Python's headers are there;
 * kvhex.adapters.storage.files.native loads it, binds the checksum and checks it against the
 * xxhash package, and falls back to the Python path otherwise. The block layout (header
 * area, then payload) and what a header holds stay in format.py: Python packs each header
 * with its checksum field zeroed and passes the field's offset; this code fills it in.
 *
 * The checksum is an XXH3-64 that the xxhash package's extension exports, found by dlsym
 * (native.py names it and checks it against xxhash): both paths write the same bytes.
 *
 * A block is a tuple (fd, offset, header, payload); header and payload are buffers the caller
 * keeps alive and unchanged for the call (host slots pinned or reserved by the tier). Blocks
 * that follow each other in one file form a run: one pwritev or preadv each.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>

#define API_VERSION 2
#define MAX_RUN_BLOCKS 512 /* two iovecs a block: IOV_MAX (1024); slabs.py's _RUN_BLOCKS */

typedef uint64_t (*hash_fn)(const void *, size_t);
static hash_fn hasher = NULL;

typedef struct {
    int fd;
    long long offset;
    Py_buffer head;
    Py_buffer body;
} block_t;

static void release_blocks(block_t *blocks, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyBuffer_Release(&blocks[i].head);
        PyBuffer_Release(&blocks[i].body);
    }
    PyMem_Free(blocks);
}

/* The blocks of `seq` with their buffers held (NULL and an exception when one is not a
 * (fd, offset, header, payload) tuple of a writable header of at least `min_head` bytes and
 * a contiguous payload, writable when `writable_body`, that ends within a file's reach).
 * The blocks are read from a tuple copy of `seq`: code run while parsing an item (an
 * __index__, a buffer export) cannot change what is being walked. */
static block_t *take_blocks(PyObject *seq, Py_ssize_t *count, Py_ssize_t min_head,
                            int writable_body) {
    PyObject *items = PySequence_Tuple(seq);
    if (items == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    block_t *blocks = PyMem_Calloc(n ? (size_t)n : 1, sizeof(block_t));
    if (blocks == NULL) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(items, i), *head, *body;
        block_t *b = &blocks[i];
        if (!PyTuple_Check(item)) {
            PyErr_Format(PyExc_TypeError, "block %zd: a block is (fd, offset, header, payload), "
                         "not a %.100s", i, Py_TYPE(item)->tp_name);
            goto fail;
        }
        if (!PyArg_ParseTuple(item, "iLOO;a block is (fd, offset, header, payload)", &b->fd,
                              &b->offset, &head, &body))
            goto fail;
        if (b->offset < 0) {
            PyErr_Format(PyExc_ValueError, "block %zd: negative offset %lld", i, b->offset);
            goto fail;
        }
        if (PyObject_GetBuffer(head, &b->head, PyBUF_WRITABLE) < 0) goto fail;
        if (b->head.len < min_head) {
            PyErr_Format(PyExc_ValueError, "block %zd: a %zd-byte header buffer is shorter "
                         "than %zd bytes", i, b->head.len, min_head);
            goto fail;
        }
        if (PyObject_GetBuffer(body, &b->body, writable_body ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
            goto fail;
        if (b->offset > LLONG_MAX - b->head.len - b->body.len) {
            PyErr_Format(PyExc_ValueError, "block %zd: offset %lld is past any file's end", i,
                         b->offset);
            goto fail;
        }
    }
    Py_DECREF(items);
    *count = n;
    return blocks;
fail:
    Py_DECREF(items);
    release_blocks(blocks, n);
    return NULL;
}

/* The end (exclusive) of the run starting at `i`: blocks of one file, each starting where
 * the previous one ends, at most MAX_RUN_BLOCKS and `max_bytes` (one block at least). */
static Py_ssize_t run_end(const block_t *blocks, Py_ssize_t n, Py_ssize_t i, Py_ssize_t max_bytes) {
    Py_ssize_t j = i + 1;
    long long end = blocks[i].offset + blocks[i].head.len + blocks[i].body.len;
    Py_ssize_t size = blocks[i].head.len + blocks[i].body.len;
    while (j < n && j - i < MAX_RUN_BLOCKS && blocks[j].fd == blocks[i].fd &&
           blocks[j].offset == end) {
        Py_ssize_t block = blocks[j].head.len + blocks[j].body.len;
        if (max_bytes > 0 && size + block > max_bytes) break;
        size += block;
        end += block;
        j++;
    }
    return j;
}

static void put_be64(unsigned char *p, uint64_t v) {
    for (int k = 7; k >= 0; k--) {
        p[k] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

/* Write all of `iov` at `offset`, after short writes too; 0 or an errno. */
static int pwritev_all(int fd, struct iovec *iov, int count, long long offset) {
    while (count > 0) {
        ssize_t done = pwritev(fd, iov, count, (off_t)offset);
        if (done < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        if (done == 0) return EIO; /* no progress: never spin */
        offset += done;
        while (count > 0 && (size_t)done >= iov->iov_len) {
            done -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= (size_t)done;
        }
    }
    return 0;
}

static int need_hasher(void) {
    if (hasher == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "no checksum bound (bind_hasher first)");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(write_blocks_doc,
"write_blocks(blocks, digest_offset, max_run_bytes) -> list[int]\n\n"
"Checksum each payload into its header (big-endian at digest_offset), then write each run of\n"
"adjacent blocks (header, payload, ...) with one pwritev, a run at most max_run_bytes (one\n"
"block at least; 0: no limit). Per block 0, or the errno that failed its run.");

static PyObject *write_blocks(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t digest_offset, max_run_bytes, n;
    if (!PyArg_ParseTuple(args, "Onn:write_blocks", &seq, &digest_offset, &max_run_bytes))
        return NULL;
    if (need_hasher() < 0) return NULL;
    if (digest_offset < 0 || digest_offset > PY_SSIZE_T_MAX - 8)
        return PyErr_Format(PyExc_ValueError, "digest_offset %zd is out of range", digest_offset);
    block_t *blocks = take_blocks(seq, &n, digest_offset + 8, 0);
    if (blocks == NULL) return NULL;
    int *errs = PyMem_Calloc(n ? (size_t)n : 1, sizeof(int));
    struct iovec *iov = PyMem_Calloc(2 * MAX_RUN_BLOCKS, sizeof(struct iovec));
    if (errs == NULL || iov == NULL) {
        PyMem_Free(errs);
        PyMem_Free(iov);
        release_blocks(blocks, n);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n;) {
        Py_ssize_t j = run_end(blocks, n, i, max_run_bytes);
        int count = 0;
        for (Py_ssize_t k = i; k < j; k++) {
            block_t *b = &blocks[k];
            put_be64((unsigned char *)b->head.buf + digest_offset,
                     hasher(b->body.buf, (size_t)b->body.len));
            iov[count].iov_base = b->head.buf;
            iov[count++].iov_len = (size_t)b->head.len;
            iov[count].iov_base = b->body.buf;
            iov[count++].iov_len = (size_t)b->body.len;
        }
        int err = pwritev_all(blocks[i].fd, iov, count, blocks[i].offset);
        for (Py_ssize_t k = i; k < j; k++) errs[k] = err;
        i = j;
    }
    Py_END_ALLOW_THREADS
    release_blocks(blocks, n);
    PyMem_Free(iov);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *err = PyLong_FromLong(errs[i]);
        if (err == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, err);
    }
    PyMem_Free(errs);
    return out;
}

PyDoc_STRVAR(read_blocks_doc,
"read_blocks(blocks, max_run_bytes) -> list[int | None]\n\n"
"Read each run of adjacent blocks with one preadv (header area into the header buffer,\n"
"payload into the payload buffer), a run at most max_run_bytes (one block at least; 0: no\n"
"limit), then checksum each payload read whole. Per block the\n"
"payload's checksum, or None where the file ends before the block does.\n"
"Raises OSError: a read failed (nothing is returned).");

static PyObject *read_blocks(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t n, max_run_bytes;
    if (!PyArg_ParseTuple(args, "On:read_blocks", &seq, &max_run_bytes)) return NULL;
    if (need_hasher() < 0) return NULL;
    block_t *blocks = take_blocks(seq, &n, 0, 1);
    if (blocks == NULL) return NULL;
    uint64_t *digests = PyMem_Calloc(n ? (size_t)n : 1, sizeof(uint64_t));
    char *whole = PyMem_Calloc(n ? (size_t)n : 1, 1);
    struct iovec *iov = PyMem_Calloc(2 * MAX_RUN_BLOCKS, sizeof(struct iovec));
    if (digests == NULL || whole == NULL || iov == NULL) {
        PyMem_Free(digests);
        PyMem_Free(whole);
        PyMem_Free(iov);
        release_blocks(blocks, n);
        return PyErr_NoMemory();
    }
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && err == 0;) {
        Py_ssize_t j = run_end(blocks, n, i, max_run_bytes);
        int count = 0;
        for (Py_ssize_t k = i; k < j; k++) {
            iov[count].iov_base = blocks[k].head.buf;
            iov[count++].iov_len = (size_t)blocks[k].head.len;
            iov[count].iov_base = blocks[k].body.buf;
            iov[count++].iov_len = (size_t)blocks[k].body.len;
        }
        ssize_t got;
        do {
            got = preadv(blocks[i].fd, iov, count, (off_t)blocks[i].offset);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            err = errno;
            break;
        }
        for (Py_ssize_t k = i; k < j; k++) { /* one preadv, as the Python path: a block cut
                                                 short is a block the file lacks */
            Py_ssize_t size = blocks[k].head.len + blocks[k].body.len;
            if (got >= size) {
                whole[k] = 1;
                digests[k] = hasher(blocks[k].body.buf, (size_t)blocks[k].body.len);
            }
            got -= size;
        }
        i = j;
    }
    Py_END_ALLOW_THREADS
    release_blocks(blocks, n);
    PyMem_Free(iov);
    PyObject *out = NULL;
    if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else {
        out = PyList_New(n);
        for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
            PyObject *item = whole[i] ? PyLong_FromUnsignedLongLong(digests[i]) : Py_NewRef(Py_None);
            if (item == NULL) {
                Py_CLEAR(out);
                break;
            }
            PyList_SET_ITEM(out, i, item);
        }
    }
    PyMem_Free(digests);
    PyMem_Free(whole);
    return out;
}

PyDoc_STRVAR(checksum_doc, "checksum(data) -> int\n\nThe bound checksum of a buffer.");

static PyObject *checksum(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (need_hasher() < 0) return NULL;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t digest;
    Py_BEGIN_ALLOW_THREADS
    digest = hasher(view.buf, (size_t)view.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(digest);
}

PyDoc_STRVAR(bind_hasher_doc,
"bind_hasher(path, symbol) -> None\n\n"
"Bind the function `symbol` (an XXH3-64 of (data, length)) from the shared library at path\n"
"(kept loaded) as the checksum.\n"
"Raises OSError: the library cannot be loaded or does not export it.");

static PyObject *bind_hasher(PyObject *self, PyObject *args) {
    PyObject *path;
    const char *symbol;
    if (!PyArg_ParseTuple(args, "O&s:bind_hasher", PyUnicode_FSConverter, &path, &symbol))
        return NULL;
    void *lib = dlopen(PyBytes_AS_STRING(path), RTLD_NOW | RTLD_LOCAL);
    Py_DECREF(path);
    if (lib == NULL) {
        const char *why = dlerror();
        return PyErr_Format(PyExc_OSError, "cannot load the checksum's library: %s",
                            why ? why : "unknown error");
    }
    void *fn = dlsym(lib, symbol);
    if (fn == NULL) {
        dlclose(lib);
        return PyErr_Format(PyExc_OSError, "the library exports no %s", symbol);
    }
    memcpy(&hasher, &fn, sizeof(hasher));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"write_blocks", write_blocks, METH_VARARGS, write_blocks_doc},
    {"read_blocks", read_blocks, METH_VARARGS, read_blocks_doc},
    {"checksum", checksum, METH_O, checksum_doc},
    {"bind_hasher", bind_hasher, METH_VARARGS, bind_hasher_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slotio",
    "The slab mover's native data path (see kvhex.adapters.storage.files.native).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__slotio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "API_VERSION", API_VERSION) < 0) Py_CLEAR(m);
    return m;
}
