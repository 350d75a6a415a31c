/* MemAvailable and SwapFree from a kept-open /proc/meminfo descriptor, in one call.
 *
 * The hook reads these two fields after every hooked call. In Python the read costs one
 * os.pread, and finding and converting the two numbers costs four bytes.find, two slices and
 * two int() calls on top: about a third of the pread itself. Here it is the pread (the GIL is
 * released around it, as os.pread does) and a scan of the first ~20 lines' starts.
 *
 * Same answers as telemetry.procfs.meminfo.parse_available_and_swap_free (the tests hold the two
 * together): bytes, or None for a field the file does not have; a value that is not a number
 * followed by "kB" raises ValueError; a failed read raises OSError. Only the first READ_SIZE
 * bytes are read, as the Python reader does.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#define READ_SIZE 16384 /* meminfo is ~1.5 kB; both fields are in its first ~500 bytes */

/* The line that starts with `label`, or NULL. Line by line (memchr to each newline, then a compare of
 * the line's start): the labels open lines, and the hook's two are in the first ~20 of them, where a
 * memmem over the text cost about three times as many instructions. */
static const char *line_starting(const char *text, size_t size, const char *label, size_t label_size) {
    const char *p = text;
    const char *end = text + size;
    while ((size_t)(end - p) >= label_size) {
        if (*p == *label && memcmp(p, label, label_size) == 0)
            return p;
        const char *newline = memchr(p, '\n', (size_t)(end - p));
        if (newline == NULL)
            return NULL;
        p = newline + 1;
    }
    return NULL;
}

/* The value of `label` in bytes; Py_None if no line starts with the label; NULL with ValueError if malformed. */
static PyObject *field_bytes(const char *text, size_t size, const char *label) {
    size_t label_size = strlen(label);
    const char *at = line_starting(text, size, label, label_size);
    if (at == NULL)
        Py_RETURN_NONE;
    const char *end = text + size;
    const char *p = at + label_size;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    unsigned long long value = 0;
    int fits = 1;
    const char *digits = p;
    while (p < end && *p >= '0' && *p <= '9') {
        unsigned long long digit = (unsigned long long)(*p - '0');
        if (value > ((~0ULL >> 10) - digit) / 10) /* value * 10 + digit, then << 10, must fit */
            fits = 0;
        value = value * 10 + digit;
        p++;
    }
    const char *digits_end = p;
    if (digits_end == digits)
        goto malformed;
    while (p < end && (*p == ' ' || *p == '\t'))
        p++;
    if (end - p < 2 || p[0] != 'k' || p[1] != 'B')
        goto malformed;
    if (fits)
        return PyLong_FromUnsignedLongLong(value << 10);
    /* Wider than 54 bits of kB: never on a real machine, but give Python's answer. */
    PyObject *text_digits = PyUnicode_FromStringAndSize(digits, digits_end - digits);
    if (text_digits == NULL)
        return NULL;
    PyObject *number = PyLong_FromUnicodeObject(text_digits, 10);
    Py_DECREF(text_digits);
    if (number == NULL)
        return NULL;
    PyObject *ten = PyLong_FromLong(10);
    PyObject *shifted = ten == NULL ? NULL : PyNumber_Lshift(number, ten);
    Py_XDECREF(ten);
    Py_DECREF(number);
    return shifted;
malformed:
    PyErr_Format(PyExc_ValueError, "/proc/meminfo: %s is not followed by a number of kB", label);
    return NULL;
}

static PyObject *read_available_and_swap_free(PyObject *module, PyObject *arg) {
    (void)module;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    if (fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "expected an open file descriptor, got %ld", fd);
        return NULL;
    }
    char text[READ_SIZE];
    ssize_t got;
    int error;
    Py_BEGIN_ALLOW_THREADS
    got = pread((int)fd, text, sizeof text, 0);
    error = errno;
    Py_END_ALLOW_THREADS
    if (got < 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    PyObject *available = field_bytes(text, (size_t)got, "MemAvailable:");
    if (available == NULL)
        return NULL;
    PyObject *swap_free = field_bytes(text, (size_t)got, "SwapFree:");
    if (swap_free == NULL) {
        Py_DECREF(available);
        return NULL;
    }
    PyObject *pair = PyTuple_Pack(2, available, swap_free);
    Py_DECREF(available);
    Py_DECREF(swap_free);
    return pair;
}

static PyMethodDef methods[] = {
    {"read_available_and_swap_free", read_available_and_swap_free, METH_O,
     "read_available_and_swap_free(fd) -> (MemAvailable, SwapFree) in bytes, None where absent.\n\n"
     "Reads the /proc/meminfo descriptor `fd` from offset 0 (pread)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_meminfo_speedups",
    "MemAvailable and SwapFree from /proc/meminfo in one call (the hook's hot path).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__meminfo_speedups(void) { return PyModule_Create(&module_def); }
