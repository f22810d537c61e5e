/* schema.c: field schemas of op argument structs and of the library's value
 * structs (the recipe, value-schemas.c): flatten to tensor slots, hash,
 * compare, validate, print. Written once here so nobody hand-writes them. */
#include <stdio.h>
#include <string.h>

#include "core/core-impl.h"
#include "op/op-impl.h"

static void *field_ptr(const void *args, const opf_field *f) { return (char *)args + f->offset; }

int opf_schema_slots(const opf_schema *s, void *args, opf_slot *slots, int max)
{
    int n = 0;
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        if (f->kind == OPF_FIELD_TENSOR || f->kind == OPF_FIELD_TENSOR_Q) {
            if (n < max) slots[n] = (opf_slot){f, field_ptr(args, f)};
            n++;
        } else if (f->kind == OPF_FIELD_BUNDLE && f->bundle) {
            n += opf_schema_slots(f->bundle, field_ptr(args, f), n < max ? slots + n : NULL,
                                  n < max ? max - n : 0);
        }
    }
    return n;
}

uint64_t opf_spec_hash(uint64_t h, const opf_spec *sp, bool skip_dim0)
{
    h = opf_hash_mix(h, (uint64_t)sp->ndim);
    for (int i = skip_dim0 ? 1 : 0; i < sp->ndim && i < OPF_MAX_DIMS; i++)
        h = opf_hash_mix(h, (uint64_t)sp->shape[i]);
    h = opf_hash_mix(h, (uint64_t)sp->dtype | (uint64_t)sp->scaling << 8 | (uint64_t)sp->qdtype << 16 |
                   (uint64_t)sp->usage << 24 | (uint64_t)sp->flags << 32);
    return h;
}

/* A pointer field (data or function) as an integer, by identity. */
static uint64_t ref_bits(const void *p)
{
    uintptr_t u;
    memcpy(&u, p, sizeof u);
    return (uint64_t)u;
}

static bool tensor_present(const opf_tensor *t) { return t->data[0] || t->data[OPF_COMP_COL_DATA]; }

/* A runtime field's value (read per call; keys see only its sign). */
static int64_t runtime_value(const opf_field *f, const void *p)
{
    return f->kind == OPF_FIELD_INT ? *(const int64_t *)p
         : f->kind == OPF_FIELD_ENUM ? *(const int *)p : (int64_t)*(const bool *)p;
}

uint64_t opf_schema_hash(const opf_schema *s, const void *args)
{
    uint64_t h = OPF_HASH_SEED;
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        const void *p = field_ptr(args, f);
        if (f->flags & OPF_FIELD_RUNTIME) {  /* the value is read per call: only set or unset */
            h = opf_hash_mix(h, runtime_value(f, p) < 0 ? 0x5E7u : 0x0FFu);
            continue;
        }
        switch (f->kind) {
        case OPF_FIELD_TENSOR:
        case OPF_FIELD_TENSOR_Q: {
            const opf_tensor *t = p;
            h = tensor_present(t) ? opf_spec_hash(h, &t->spec, false) : opf_hash_mix(h, 0);
            break;
        }
        case OPF_FIELD_QUANTIZER: h = opf_hash_mix(h, opf_quantizer_hash(p)); break;
        case OPF_FIELD_INT: h = opf_hash_mix(h, (uint64_t)*(const int64_t *)p); break;
        case OPF_FIELD_FLOAT: { uint64_t u; memcpy(&u, p, 8); h = opf_hash_mix(h, u); break; }
        case OPF_FIELD_BOOL: h = opf_hash_mix(h, *(const bool *)p); break;
        case OPF_FIELD_ENUM: h = opf_hash_mix(h, (uint64_t)*(const int *)p); break;
        case OPF_FIELD_BUNDLE: h = opf_hash_mix(h, f->bundle ? opf_schema_hash(f->bundle, p) : 0); break;
        case OPF_FIELD_REF: h = opf_hash_mix(h, ref_bits(p)); break;
        case OPF_FIELD_F32: h = opf_hash_mix(h, opf_f32_bits(*(const float *)p)); break;
        case OPF_FIELD_I32: h = opf_hash_mix(h, (uint64_t)(int64_t)*(const int *)p); break;
        default: break;
        }
    }
    return h;
}

static bool field_equal(const opf_field *f, const void *a, const void *b)
{
    if (f->flags & OPF_FIELD_RUNTIME) return (runtime_value(f, a) < 0) == (runtime_value(f, b) < 0);
    switch (f->kind) {
    case OPF_FIELD_TENSOR:
    case OPF_FIELD_TENSOR_Q: {
        const opf_tensor *x = a, *y = b;
        if (tensor_present(x) != tensor_present(y)) return false;
        return !tensor_present(x) || opf_spec_equal(&x->spec, &y->spec);
    }
    case OPF_FIELD_QUANTIZER: return opf_quantizer_equal(a, b);
    case OPF_FIELD_INT: return *(const int64_t *)a == *(const int64_t *)b;
    case OPF_FIELD_FLOAT: return !memcmp(a, b, sizeof(double));
    case OPF_FIELD_BOOL: return *(const bool *)a == *(const bool *)b;
    case OPF_FIELD_ENUM:
    case OPF_FIELD_I32: return *(const int *)a == *(const int *)b;
    case OPF_FIELD_BUNDLE: return !f->bundle || opf_schema_equal(f->bundle, a, b);
    case OPF_FIELD_REF: return ref_bits(a) == ref_bits(b);
    case OPF_FIELD_F32: return opf_f32_bits(*(const float *)a) == opf_f32_bits(*(const float *)b);
    default: return true;
    }
}

bool opf_schema_equal(const opf_schema *s, const void *a, const void *b)
{
    if (!a || !b) return a == b;
    for (int i = 0; i < s->n_fields; i++)
        if (!field_equal(&s->fields[i], field_ptr(a, &s->fields[i]), field_ptr(b, &s->fields[i])))
            return false;
    return true;
}

/* The first present tensor of a call, which every other must share a
 * device with (core-impl.h: one device per call). */
typedef struct first_tensor {
    const opf_tensor *t;
    const char       *name;
} first_tensor;

static opf_status check_device(const opf_schema *s, const opf_field *f, const opf_tensor *t,
                               first_tensor *first)
{
    if (!first->t) {
        *first = (first_tensor){t, f->name};
        return OPF_OK;
    }
    return opf_same_device(NULL, s->name, 2, (const opf_spec *[]){&first->t->spec, &t->spec},
                           (const char *[]){first->name, f->name}, NULL);
}

static opf_status validate_fields(const opf_schema *s, const void *args, first_tensor *first)
{
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        const void *p = field_ptr(args, f);
        if ((unsigned)f->kind >= OPF_FIELD_KIND_COUNT)
            return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: field \"%s\" has kind %d", s->name,
                             f->name, (int)f->kind);
        if (f->kind == OPF_FIELD_TENSOR || f->kind == OPF_FIELD_TENSOR_Q) {
            const opf_tensor *t = p;
            bool present = t->data[0] || t->data[OPF_COMP_COL_DATA];
            if (!present && !(f->flags & OPF_FIELD_OPTIONAL))
                return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: tensor \"%s\" is missing",
                                 s->name, f->name);
            if (present && f->kind == OPF_FIELD_TENSOR && t->spec.scaling != OPF_SCALING_NONE)
                return opf_error(NULL, OPF_ERR_DTYPE, "%s: tensor \"%s\" must be plain, got %s",
                                 s->name, f->name, opf_scaling_name(t->spec.scaling));
            opf_status st = present ? check_device(s, f, t, first) : OPF_OK;
            if (st) return st;
        } else if (f->kind == OPF_FIELD_BUNDLE && f->bundle) {
            opf_status st = validate_fields(f->bundle, p, first);
            if (st) return st;
        } else if (f->kind == OPF_FIELD_ENUM && f->bundle &&
                   (unsigned)*(const int *)p >= (unsigned)f->bundle->n_fields) {
            return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: %s %d outside 0..%d", s->name, f->name,
                             *(const int *)p, f->bundle->n_fields - 1);
        }
    }
    return OPF_OK;
}

opf_status opf_schema_validate(const opf_schema *s, const void *args)
{
    first_tensor first = {NULL, NULL};
    return validate_fields(s, args, &first);
}

int opf_field_print(const opf_field *f, const void *p, char *buf, size_t size)
{
    char sb[128];
    switch (f->kind) {
    case OPF_FIELD_TENSOR:
    case OPF_FIELD_TENSOR_Q: {
        const opf_tensor *t = p;
        if (!t->data[0] && !t->data[OPF_COMP_COL_DATA]) return snprintf(buf, size, "none");
        opf_spec_str(&t->spec, sb, sizeof sb);
        return snprintf(buf, size, "%s", sb);
    }
    case OPF_FIELD_QUANTIZER: {
        const opf_quantizer *q = p;
        return snprintf(buf, size, "%s/%s", opf_scaling_name(q->scaling), opf_dtype_name(q->qdtype));
    }
    case OPF_FIELD_INT: return snprintf(buf, size, "%lld", (long long)*(const int64_t *)p);
    case OPF_FIELD_FLOAT: return snprintf(buf, size, "%g", *(const double *)p);
    case OPF_FIELD_BOOL: return snprintf(buf, size, "%s", *(const bool *)p ? "true" : "false");
    case OPF_FIELD_ENUM: {
        int v = *(const int *)p;
        if (f->bundle && (unsigned)v < (unsigned)f->bundle->n_fields)
            return snprintf(buf, size, "%s", f->bundle->fields[v].name);
        return snprintf(buf, size, "%d", v);
    }
    case OPF_FIELD_F32: return snprintf(buf, size, "%.9g", (double)*(const float *)p);
    case OPF_FIELD_I32: return snprintf(buf, size, "%d", *(const int *)p);
    case OPF_FIELD_BUNDLE:
        if (!f->bundle) return snprintf(buf, size, "{}");
        opf_schema_print(f->bundle, p, buf, size);
        return (int)strlen(buf);
    case OPF_FIELD_REF: return snprintf(buf, size, "0x%llx", (unsigned long long)ref_bits(p));
    default: return snprintf(buf, size, "?");
    }
}

void opf_schema_print(const opf_schema *s, const void *args, char *buf, size_t size)
{
    if (!size) return;
    size_t n = (size_t)snprintf(buf, size, "%s{", s->name);
    for (int i = 0; i < s->n_fields && n < size; i++) {
        const opf_field *f = &s->fields[i];
        n += (size_t)snprintf(buf + n, size - n, "%s%s: ", i ? ", " : "", f->name);
        if (n < size) n += (size_t)opf_field_print(f, field_ptr(args, f), buf + n, size - n);
    }
    if (n < size) snprintf(buf + n, size - n, "}");
    buf[size - 1] = '\0';
}

const opf_field *opf_schema_field(const opf_schema *s, const char *name)
{
    for (int i = 0; s && name && i < s->n_fields; i++)
        if (!strcmp(s->fields[i].name, name)) return &s->fields[i];
    return NULL;
}
