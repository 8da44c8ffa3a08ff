/* _lines: the number arrays of a JSONL file, parsed in compiled code.
 *
 * columns(data, fields) reads ``data`` (a bytes object: one JSON object per line) and returns,
 * for each named field (name, kind, wrap), its values on every line: (lines, {name: (values,
 * offsets)}), the values as the bytes of an int64 / bool / float64 array, offsets (int64,
 * lines + 1) for a list field and None for a scalar; ``wrap`` one-element lists around the
 * value are taken off (NeMo-RL's logger writes ``[[t0, t1, ...]]``). It answers None wherever Python's ``json`` (what the
 * reference reader runs) would refuse a line or read it otherwise, or where a value is not of
 * its field's kind, so a caller falls back to a slower reader that says what is wrong. It
 * accepts only a subset of what ``json`` accepts and gives exactly the values ``json`` gives:
 *
 *   - every line is spaces or tabs, one JSON object, spaces or tabs; no blank line, no "\r";
 *   - every value is validated as ``json`` validates it, the fields not named too (strings:
 *     no control character, the escapes JSON has, UTF-8 as Python's strict decoder takes it;
 *     NaN, Infinity and -Infinity, which ``json`` takes); keys with escapes are left to the
 *     slower reader, and so is a named field given twice (``json`` keeps the last);
 *   - every named field is on every line (a field of kind ABSENT on none), of its kind: an
 *     integer that fits int64 (INT, INT_LIST), true or false (BOOL_LIST), a number (FLOAT,
 *     FLOAT_LIST, which also takes null), inside exactly its ``wrap`` one-element lists;
 *   - a float is the double nearest the decimal (what ``float(text)`` gives): up to 15
 *     significant digits and a power of ten up to 22, one IEEE operation on exact operands;
 *     up to 19 digits and a power up to 27, one x87 extended operation (exact operands, one
 *     rounding to 64 bits) and the rounding to a double, which is exact unless the extended
 *     result lies on a halfway point between two doubles; any other number, and that case,
 *     through PyOS_string_to_double, Python's own ``float`` (holding the interpreter lock);
 *     a list's plain decimal of up to 19 digits takes a shorter path to the same value
 *     (``fast_float``: one division where its digits make an integer up to 2^53, else the
 *     paths above with the digits already read; ids: ``fast_int``);
 *   - an integer of more than MAX_INT_DIGITS digits anywhere is left to the slower reader
 *     (``json``'s int() refuses more than sys.get_int_max_str_digits(), 640 at the least);
 *   - an integer in a float list is its value as a double (``-0`` is 0.0, as for ``json``,
 *     whose int 0 becomes 0.0); null in a float list is NaN; NaN, Infinity, -Infinity and
 *     a number past a double's range are json's NaN, inf and -inf.
 *
 * The interpreter lock is released while a file is parsed, so files parse on every core.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum kind { K_INT = 0, K_INT_LIST = 1, K_BOOL_LIST = 2, K_FLOAT_LIST = 3, K_ABSENT = 4, K_FLOAT = 5 };
#define MAX_WRAP 4
#define MAX_FIELDS 16
#define MAX_DEPTH 64
#define MAX_EXPONENT 100000 /* beyond any double's decimal exponent and any digit count here */
#define MAX_INT_DIGITS 640  /* the least limit sys.set_int_max_str_digits allows */
#define BAIL (-1)
#define NOMEM (-2)

typedef struct {
    char *data;
    Py_ssize_t len, cap; /* bytes */
} buf_t;

typedef struct {
    const char *name;
    Py_ssize_t name_len;
    int kind;
    int wrap; /* the value comes inside this many one-element lists: [[...]] is 1 for a list */
    buf_t values, offsets;
    Py_ssize_t count; /* values so far */
    int seen;         /* on the current line */
} field_t;

typedef struct {
    const unsigned char *p, *end; /* the current line: [p, end) */
    PyThreadState *saved;         /* the released interpreter lock */
    int bad;                      /* a slow-path conversion failed: the caller bails */
} cursor_t;

static int buf_grow(buf_t *b, Py_ssize_t size)
{
    {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 1 << 16;
        while (cap < b->len + size)
            cap *= 2;
        char *grown = realloc(b->data, (size_t)cap);
        if (!grown)
            return NOMEM;
        b->data = grown;
        b->cap = cap;
    }
    return 0;
}

static inline int buf_push(buf_t *b, const void *item, Py_ssize_t size)
{
    if (b->len + size > b->cap && buf_grow(b, size))
        return NOMEM;
    memcpy(b->data + b->len, item, (size_t)size);
    b->len += size;
    return 0;
}

static void skip_ws(cursor_t *c)
{
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t'))
        c->p++;
}

static int is_digit(unsigned char ch) { return ch >= '0' && ch <= '9'; }

/* A JSON number at c->p: its grammar checked (-?(0|[1-9]d*)(.d+)?([eE][+-]?d+)?), then
 * followed by a delimiter. Sets *is_int, and the parts a conversion needs. */
typedef struct {
    const unsigned char *start, *stop;
    int negative, is_int, digits; /* significant digits, leading zeros not counted */
    uint64_t mantissa;            /* the first 19 significant digits */
    long long exponent;           /* the decimal exponent of the mantissa's last digit */
} number_t;

static inline int scan_number(cursor_t *c, number_t *n)
{
    /* The digit loops need no bound: the byte at a line's end is its "\n" or, on the last
     * line, the NUL that ends every bytes object, neither of them a digit. */
    const unsigned char *p = c->p, *end = c->end, *digits;
    int negative = 0, is_int = 1, count = 0;
    Py_ssize_t dropped = 0; /* significant digits beyond the 19th */
    uint64_t mantissa = 0;
    long long exponent = 0;
    n->start = p;
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end || !is_digit(*p))
        return BAIL;
    if (*p == '0') {
        p++;
    } else {
        for (digits = p; is_digit(*p); p++)
            ;
        Py_ssize_t len = p - digits;
        count = len < 19 ? (int)len : 19;
        for (int k = 0; k < count; k++)
            mantissa = mantissa * 10 + (uint64_t)(digits[k] - '0');
        dropped = len - count;
        exponent = dropped;
    }
    if (p < end && *p == '.') {
        is_int = 0;
        digits = ++p;
        for (; is_digit(*p); p++)
            ;
        if (p == digits)
            return BAIL;
        if (count == 0) /* leading zeros are not significant */
            for (; digits < p && *digits == '0'; digits++)
                exponent--;
        for (; digits < p; digits++) {
            if (count < 19) {
                mantissa = mantissa * 10 + (uint64_t)(*digits - '0');
                count++;
                exponent--;
            } else {
                dropped++;
            }
        }
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        p++;
        int minus = 0;
        if (p < end && (*p == '+' || *p == '-'))
            minus = *p++ == '-';
        if (p >= end || !is_digit(*p))
            return BAIL;
        long long e = 0;
        for (; is_digit(*p); p++)
            if (e < MAX_EXPONENT)
                e = e * 10 + (*p - '0');
        if (e >= MAX_EXPONENT)
            dropped = 1; /* an exponent past any double's range: the slow path reads it all */
        exponent += minus ? -e : e;
    }
    if (p < end && !(*p == ',' || *p == ']' || *p == '}' || *p == ' ' || *p == '\t'))
        return BAIL; /* "01", "1.5.3", "1x": not one JSON number */
    if (is_int && p - n->start > MAX_INT_DIGITS)
        return BAIL; /* json's int() may refuse it (sys.get_int_max_str_digits) */
    n->negative = negative;
    n->is_int = is_int;
    n->digits = dropped ? 20 : count; /* 20: more than the mantissa holds, the slow path */
    n->mantissa = mantissa;
    n->exponent = exponent;
    n->stop = p;
    c->p = p;
    return 0;
}

#if defined(__x86_64__) && LDBL_MANT_DIG == 64
static long double p10l[28]; /* 10^k, exact in 64 bits for k <= 27 (5^27 < 2^64): PyInit */
#endif

static const double P10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                             1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                             1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* Python's float(text) of the number's text, with the interpreter lock held. */
static int slow_double(cursor_t *c, const number_t *n, double *out)
{
    char small[64];
    Py_ssize_t len = n->stop - n->start;
    char *text = len < (Py_ssize_t)sizeof small ? small : malloc((size_t)len + 1);
    if (!text)
        return NOMEM;
    memcpy(text, n->start, (size_t)len);
    text[len] = 0;
    PyEval_RestoreThread(c->saved);
    char *stop = NULL;
    double value = PyOS_string_to_double(text, &stop, NULL);
    int ok = !PyErr_Occurred() && stop == text + len;
    PyErr_Clear();
    c->saved = PyEval_SaveThread();
    if (text != small)
        free(text);
    if (!ok)
        return BAIL;
    *out = value;
    return 0;
}

static inline int to_double(cursor_t *c, const number_t *n, double *out)
{
    double value;
    if (n->mantissa == 0 && n->digits <= 19) {
        value = 0.0; /* the integer -0 is json's int 0: 0.0; "-0.0" and "-0e1" are -0.0 */
        *out = (n->negative && !n->is_int) ? -value : value;
        return 0;
    }
    long long e = n->exponent;
    if (n->digits <= 15 && e >= -22 && e <= 22) {
        double m = (double)n->mantissa; /* exact: below 2^53 */
        value = e < 0 ? m / P10[-e] : m * P10[e];
        *out = n->negative ? -value : value;
        return 0;
    }
#if defined(__x86_64__) && LDBL_MANT_DIG == 64
    if (n->digits <= 19 && e >= -27 && e <= 27) {
        long double m = (long double)n->mantissa; /* exact: below 2^64 */
        long double q = e < 0 ? m / p10l[-e] : m * p10l[e];
        uint64_t bits;
        memcpy(&bits, &q, sizeof bits); /* the 64-bit significand */
        if ((bits & 0x7FF) != 0x400) {  /* not on a halfway point between two doubles */
            value = (double)q;
            *out = n->negative ? -value : value;
            return 0;
        }
    }
#endif
    int status = slow_double(c, n, &value);
    if (status)
        return status;
    *out = value;
    return 0;
}

static int hex_digit(unsigned char ch)
{
    return is_digit(ch) || (ch >= 'a' && ch <= 'f') || (ch >= 'A' && ch <= 'F');
}

/* A JSON string at c->p (the opening quote), validated; *escaped: it holds an escape. */
static int scan_string(cursor_t *c, int *escaped)
{
    const unsigned char *p = c->p + 1, *end = c->end;
    *escaped = 0;
    while (p < end) {
        unsigned char ch = *p;
        if (ch == '"') {
            c->p = p + 1;
            return 0;
        }
        if (ch < 0x20)
            return BAIL; /* json (strict) refuses control characters in strings */
        if (ch == '\\') {
            *escaped = 1;
            if (p + 1 >= end)
                return BAIL;
            unsigned char e = p[1];
            if (e == 'u') {
                if (p + 6 > end || !hex_digit(p[2]) || !hex_digit(p[3]) || !hex_digit(p[4]) ||
                    !hex_digit(p[5]))
                    return BAIL;
                p += 6;
            } else if (strchr("\"\\/bfnrt", e) && e) {
                p += 2;
            } else {
                return BAIL;
            }
            continue;
        }
        if (ch < 0x80) {
            p++;
            continue;
        }
        /* UTF-8 as Python's strict decoder takes it: no overlong form, no surrogate, at most
         * U+10FFFF. */
        int more;
        unsigned char lo = 0x80, hi = 0xBF;
        if (ch >= 0xC2 && ch <= 0xDF) {
            more = 1;
        } else if (ch >= 0xE0 && ch <= 0xEF) {
            more = 2;
            if (ch == 0xE0)
                lo = 0xA0;
            if (ch == 0xED)
                hi = 0x9F;
        } else if (ch >= 0xF0 && ch <= 0xF4) {
            more = 3;
            if (ch == 0xF0)
                lo = 0x90;
            if (ch == 0xF4)
                hi = 0x8F;
        } else {
            return BAIL;
        }
        if (p + more >= end)
            return BAIL;
        if (p[1] < lo || p[1] > hi)
            return BAIL;
        for (int k = 2; k <= more; k++)
            if (p[k] < 0x80 || p[k] > 0xBF)
                return BAIL;
        p += more + 1;
    }
    return BAIL; /* no closing quote on the line */
}

static int literal(cursor_t *c, const char *word, Py_ssize_t len)
{
    if (c->end - c->p < len || memcmp(c->p, word, (size_t)len) != 0)
        return BAIL;
    c->p += len;
    return 0;
}

/* An opening bracket and the spaces after it: 1 where the closing one follows at once (an
 * empty list or object, consumed), 0 where an item follows, BAIL on anything else. */
static int opened(cursor_t *c, unsigned char open, unsigned char close)
{
    if (c->p >= c->end || *c->p != open)
        return BAIL;
    c->p++;
    skip_ws(c);
    if (c->p < c->end && *c->p == close) {
        c->p++;
        return 1;
    }
    return 0;
}

/* After an item of a list or a member of an object: a comma and spaces (0: another item
 * follows) or the closing bracket (1: consumed, the end), else BAIL. */
static int after_item(cursor_t *c, unsigned char close)
{
    skip_ws(c);
    if (c->p >= c->end)
        return BAIL;
    if (*c->p == close) {
        c->p++;
        return 1;
    }
    if (*c->p != ',')
        return BAIL;
    c->p++;
    skip_ws(c);
    return 0;
}

/* json's NaN, Infinity and -Infinity (float('nan'), inf, -inf) at c->p: 0 and the value, or 1
 * (nothing consumed) where none of them is there. */
static inline int constant(cursor_t *c, double *v)
{
    unsigned char ch = c->p < c->end ? *c->p : 0;
    if (ch != 'N' && ch != 'I' && !(ch == '-' && c->p + 1 < c->end && c->p[1] == 'I'))
        return 1;
    if (literal(c, "NaN", 3) == 0) {
        uint64_t bits = 0x7FF8000000000000ULL; /* float('nan'): the positive quiet NaN */
        memcpy(v, &bits, sizeof bits);
    } else if (literal(c, "Infinity", 8) == 0) {
        *v = Py_HUGE_VAL;
    } else if (literal(c, "-Infinity", 9) == 0) {
        *v = -Py_HUGE_VAL;
    } else {
        return 1;
    }
    return 0;
}

/* Any JSON value at c->p, validated and skipped. */
static int skip_value(cursor_t *c, int depth)
{
    if (c->p >= c->end || depth > MAX_DEPTH)
        return BAIL;
    unsigned char ch = *c->p;
    int escaped;
    number_t n;
    double constant_value;
    switch (ch) {
    case '"':
        return scan_string(c, &escaped);
    case 't':
        return literal(c, "true", 4);
    case 'f':
        return literal(c, "false", 5);
    case 'n':
        return literal(c, "null", 4);
    case '[':
    case '{': {
        unsigned char close = ch == '[' ? ']' : '}';
        for (int next = opened(c, ch, close); next != 1;) {
            if (next < 0)
                return next;
            if (close == '}') {
                if (c->p >= c->end || *c->p != '"' || scan_string(c, &escaped))
                    return BAIL;
                skip_ws(c);
                if (c->p >= c->end || *c->p != ':')
                    return BAIL;
                c->p++;
                skip_ws(c);
            }
            if (skip_value(c, depth + 1))
                return BAIL;
            next = after_item(c, close);
        }
        return 0;
    }
    default:
        return constant(c, &constant_value) == 0 ? 0 : scan_number(c, &n);
    }
}

/* One element of a named list field, appended to its values. */
static inline int list_item(cursor_t *c, field_t *f)
{
    if (f->kind == K_BOOL_LIST) {
        unsigned char v = c->p < c->end && *c->p == 't';
        if (literal(c, v ? "true" : "false", v ? 4 : 5))
            return BAIL;
        return buf_push(&f->values, &v, 1);
    }
    int floats = f->kind == K_FLOAT_LIST || f->kind == K_FLOAT;
    if (f->kind == K_FLOAT_LIST && c->p < c->end && *c->p == 'n') {
        if (literal(c, "null", 4))
            return BAIL;
        uint64_t bits = 0x7FF8000000000000ULL; /* NaN, as float_array reads None */
        return buf_push(&f->values, &bits, sizeof bits);
    }
    double d;
    if (floats && constant(c, &d) == 0)
        return buf_push(&f->values, &d, sizeof d);
    number_t n;
    if (scan_number(c, &n))
        return BAIL;
    if (floats) {
        int status = to_double(c, &n, &d); /* past a double's range: inf, as for json */
        if (status)
            return status;
        return buf_push(&f->values, &d, sizeof d);
    }
    /* K_INT_LIST, K_INT: an integer that fits int64 (up to 18 digits) */
    if (!n.is_int || n.digits > 18)
        return BAIL;
    int64_t v = n.negative ? -(int64_t)n.mantissa : (int64_t)n.mantissa;
    return buf_push(&f->values, &v, sizeof v);
}

/* The common items of number lists, on a fast path that gives what ``list_item`` gives: a
 * plain decimal (no exponent) of at most FAST_DIGITS digits, leading zeros included, followed
 * by a delimiter. A float whose digits make an integer up to 2^53 is one IEEE division of
 * exact operands (a power of ten up to 10^18): the double nearest the decimal, as every path
 * of ``to_double`` gives; a larger one (a 16- to 19-digit repr) goes to ``to_double`` with
 * the digits already read. Anything else (null, NaN, an exponent, more digits, text that is
 * not one JSON number) returns 1 with nothing consumed: ``list_item`` reads it, or bails. */
#define FAST_DIGITS 19 /* 10^19 - 1 < 2^64: the mantissa cannot overflow */

static inline int delimiter(unsigned char ch)
{
    return ch == ',' || ch == ']' || ch == '}' || ch == ' ' || ch == '\t';
}

/* The digits at p, at most FAST_DIGITS in all (*count, leading zeros included): the mantissa
 * accumulated, the pointer past them (no bound needed: see ``scan_number``); a digit left
 * at the pointer is not a delimiter, so the caller leaves the number to ``list_item``. Eight
 * digits at a time (SWAR) measured no faster here: most runs are of one to six digits. */
static inline const unsigned char *digits_of(const unsigned char *p, uint64_t *m, int *count)
{
    uint64_t v = *m;
    int n = *count;
    for (; is_digit(*p) && n < FAST_DIGITS; p++, n++)
        v = v * 10 + (uint64_t)(*p - '0');
    *m = v;
    *count = n;
    return p;
}

/* The decimal digits of m > 0 (its significant digits: leading zeros add nothing to it). */
static inline int significant(uint64_t m)
{
    int n = 1;
    for (; m >= 10; m /= 10)
        n++;
    return n;
}

/* The sign and integer part of a number at p: the pointer past them, or NULL where no digit
 * follows the sign. A leading 0 is read alone ("0", "0.5"; "01" then fails the caller's
 * delimiter test). */
static inline const unsigned char *integer_part(const unsigned char *p, int *negative,
                                                uint64_t *m, int *count)
{
    *negative = *p == '-';
    p += *negative;
    if (!is_digit(*p))
        return NULL;
    if (*p != '0')
        return digits_of(p, m, count);
    (*count)++;
    return p + 1;
}

static inline int fast_float(cursor_t *c, field_t *f)
{
    uint64_t m = 0;
    int negative, count = 0, fraction = 0, is_int = 1;
    const unsigned char *p = integer_part(c->p, &negative, &m, &count);
    if (!p)
        return 1;
    if (*p == '.') {
        const unsigned char *start = ++p;
        p = digits_of(p, &m, &count);
        fraction = (int)(p - start);
        is_int = 0;
        if (!fraction)
            return 1;
    }
    if (!delimiter(*p))
        return 1;
    double d;
    if (m > (1ULL << 53)) { /* scan_number's reading of these digits, not read again */
        number_t n = {.start = c->p, .stop = p, .negative = negative, .is_int = is_int,
                      .digits = significant(m), .mantissa = m, .exponent = -fraction};
        int status = to_double(c, &n, &d);
        if (status)
            return status;
    } else if (m == 0) { /* the integer -0 is json's int 0: 0.0; "-0.0" is -0.0 */
        d = (negative && !is_int) ? -0.0 : 0.0;
    } else {
        d = (double)m / P10[fraction];
        d = negative ? -d : d;
    }
    c->p = p;
    return buf_push(&f->values, &d, sizeof d);
}

static inline int fast_int(cursor_t *c, field_t *f)
{
    uint64_t m = 0;
    int negative, count = 0;
    const unsigned char *p = integer_part(c->p, &negative, &m, &count);
    if (!p || count > 18 || !delimiter(*p)) /* up to 18 digits fit int64, as list_item takes */
        return 1;
    int64_t v = negative ? -(int64_t)m : (int64_t)m;
    c->p = p;
    return buf_push(&f->values, &v, sizeof v);
}

/* One element of a named list field, on the fast path where it applies. */
static inline int list_element(cursor_t *c, field_t *f)
{
    int status = 1;
    if (f->kind == K_FLOAT_LIST)
        status = fast_float(c, f);
    else if (f->kind == K_INT_LIST)
        status = fast_int(c, f);
    return status == 1 ? list_item(c, f) : status;
}

static int bracket(cursor_t *c, unsigned char ch)
{
    if (c->p >= c->end || *c->p != ch)
        return BAIL;
    c->p++;
    skip_ws(c);
    return 0;
}

static int unwrapped_value(cursor_t *c, field_t *f);

/* A named field's value, inside its ``wrap`` one-element lists. */
static int named_value(cursor_t *c, field_t *f)
{
    if (f->kind == K_ABSENT || f->seen)
        return BAIL;
    f->seen = 1;
    for (int w = 0; w < f->wrap; w++)
        if (bracket(c, '['))
            return BAIL;
    int status = unwrapped_value(c, f);
    if (status)
        return status;
    for (int w = 0; w < f->wrap; w++) {
        skip_ws(c);
        if (bracket(c, ']'))
            return BAIL; /* an empty list or one of more elements: another reader decides */
    }
    return 0;
}

static int unwrapped_value(cursor_t *c, field_t *f)
{
    if (f->kind == K_INT || f->kind == K_FLOAT) {
        f->count++;
        return list_item(c, f);
    }
    for (int next = opened(c, '[', ']'); next != 1;) {
        if (next < 0)
            return next;
        int status = list_element(c, f);
        if (status)
            return status;
        f->count++;
        next = after_item(c, ']');
    }
    int64_t at = (int64_t)f->count;
    return buf_push(&f->offsets, &at, sizeof at);
}

/* One line: an object whose named fields are read and the others validated and skipped. */
static int parse_line(cursor_t *c, field_t *fields, int nfields)
{
    for (int i = 0; i < nfields; i++)
        fields[i].seen = 0;
    skip_ws(c);
    for (int next = opened(c, '{', '}'); next != 1;) { /* BAIL: blank, or not an object */
        if (next < 0)
            return next;
        const unsigned char *key = c->p + 1;
        int escaped;
        if (c->p >= c->end || *c->p != '"' || scan_string(c, &escaped) || escaped)
            return BAIL;
        Py_ssize_t key_len = (c->p - 1) - key;
        skip_ws(c);
        if (c->p >= c->end || *c->p != ':')
            return BAIL;
        c->p++;
        skip_ws(c);
        field_t *f = NULL;
        for (int i = 0; i < nfields; i++)
            if (fields[i].name_len == key_len && !memcmp(fields[i].name, key, (size_t)key_len))
                f = &fields[i];
        int status = f ? named_value(c, f) : skip_value(c, 0);
        if (status)
            return status;
        next = after_item(c, '}');
    }
    skip_ws(c);
    if (c->p != c->end)
        return BAIL; /* two objects on one line, or text after the object */
    for (int i = 0; i < nfields; i++)
        if (!fields[i].seen && fields[i].kind != K_ABSENT)
            return BAIL; /* a missing field: the slower reader names it */
    return 0;
}

static int parse_all(const unsigned char *data, Py_ssize_t len, field_t *fields, int nfields,
                     Py_ssize_t *lines, PyThreadState **saved)
{
    cursor_t c = {.saved = *saved};
    const unsigned char *at = data, *end = data + len;
    int status = 0;
    int64_t zero = 0;
    for (int i = 0; i < nfields && !status; i++)
        if (fields[i].kind <= K_FLOAT_LIST && fields[i].kind != K_INT)
            status = buf_push(&fields[i].offsets, &zero, sizeof zero);
    if (memchr(data, '\r', (size_t)len))
        status = BAIL;
    while (!status && at < end) {
        const unsigned char *nl = memchr(at, '\n', (size_t)(end - at));
        c.p = at;
        c.end = nl ? nl : end;
        status = parse_line(&c, fields, nfields);
        (*lines)++;
        at = nl ? nl + 1 : end;
    }
    *saved = c.saved;
    return status;
}

static PyObject *as_bytes(buf_t *b)
{
    return PyBytes_FromStringAndSize(b->data ? b->data : "", b->len);
}

static PyObject *columns(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *data, *spec;
    if (!PyArg_ParseTuple(args, "SO!:columns", &data, &PyTuple_Type, &spec))
        return NULL;
    Py_ssize_t nfields = PyTuple_GET_SIZE(spec);
    if (nfields > MAX_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "too many fields");
        return NULL;
    }
    field_t fields[MAX_FIELDS];
    memset(fields, 0, sizeof fields);
    for (Py_ssize_t i = 0; i < nfields; i++) {
        const char *name;
        Py_ssize_t name_len;
        int kind, wrap;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(spec, i), "s#ii", &name, &name_len, &kind, &wrap))
            return NULL;
        if (kind < K_INT || kind > K_FLOAT || wrap < 0 || wrap > MAX_WRAP) {
            PyErr_SetString(PyExc_ValueError, "unknown field kind or wrap");
            return NULL;
        }
        fields[i].wrap = wrap;
        fields[i].name = name;
        fields[i].name_len = name_len;
        fields[i].kind = kind;
    }
    Py_ssize_t lines = 0;
    PyThreadState *saved = PyEval_SaveThread();
    int status = parse_all((const unsigned char *)PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data),
                           fields, (int)nfields, &lines, &saved);
    PyEval_RestoreThread(saved);
    PyObject *result = NULL;
    if (status == NOMEM) {
        PyErr_NoMemory();
    } else if (status == BAIL || lines == 0) {
        result = Py_NewRef(Py_None);
    } else {
        PyObject *found = PyDict_New();
        for (Py_ssize_t i = 0; found && i < nfields; i++) {
            field_t *f = &fields[i];
            if (f->kind == K_ABSENT)
                continue;
            PyObject *item = Py_BuildValue(
                "(NN)", as_bytes(&f->values),
                f->kind == K_INT || f->kind == K_FLOAT ? Py_NewRef(Py_None)
                                                       : as_bytes(&f->offsets));
            if (!item || PyDict_SetItemString(found, f->name, item) < 0)
                Py_CLEAR(found);
            Py_XDECREF(item);
        }
        if (found)
            result = Py_BuildValue("(nN)", lines, found);
    }
    for (Py_ssize_t i = 0; i < nfields; i++) {
        free(fields[i].values.data);
        free(fields[i].offsets.data);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"columns", columns, METH_VARARGS,
     "columns(data: bytes, fields: tuple[tuple[str, kind, wrap], ...]) -> (lines, {name: "
     "(values, offsets)}) | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "_lines", .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__lines(void)
{
#if defined(__x86_64__) && LDBL_MANT_DIG == 64
    long double t = 1.0L;
    for (int k = 0; k < 28; k++, t *= 10.0L)
        p10l[k] = t;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "INT", K_INT) < 0 ||
              PyModule_AddIntConstant(m, "INT_LIST", K_INT_LIST) < 0 ||
              PyModule_AddIntConstant(m, "BOOL_LIST", K_BOOL_LIST) < 0 ||
              PyModule_AddIntConstant(m, "FLOAT_LIST", K_FLOAT_LIST) < 0 ||
              PyModule_AddIntConstant(m, "ABSENT", K_ABSENT) < 0 ||
              PyModule_AddIntConstant(m, "FLOAT", K_FLOAT) < 0))
        Py_CLEAR(m);
    return m;
}
