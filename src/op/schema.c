/* schema.c: field schemas of op argument structs: flatten to tensor slots,
 * hash, validate, print. Written once here so no op hand-writes them. */
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

static uint64_t mix(uint64_t h, uint64_t v)
{
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0x100000001B3ull;
}

static uint64_t hash_spec(uint64_t h, const opf_spec *sp)
{
    h = mix(h, (uint64_t)sp->ndim);
    for (int i = 0; i < sp->ndim && i < OPF_MAX_DIMS; i++) h = mix(h, (uint64_t)sp->shape[i]);
    h = mix(h, (uint64_t)sp->dtype | (uint64_t)sp->scaling << 8 | (uint64_t)sp->qdtype << 16 |
                   (uint64_t)sp->usage << 24 | (uint64_t)sp->flags << 32);
    return h;
}

uint64_t opf_schema_hash(const opf_schema *s, const void *args)
{
    uint64_t h = 0xCBF29CE484222325ull;
    for (int i = 0; i < s->n_fields; i++) {
        const opf_field *f = &s->fields[i];
        const void *p = field_ptr(args, f);
        if (f->flags & OPF_FIELD_RUNTIME) {  /* the value is read per call: only set or unset */
            int64_t v = f->kind == OPF_FIELD_INT ? *(const int64_t *)p
                      : f->kind == OPF_FIELD_ENUM ? *(const int *)p : (int64_t)*(const bool *)p;
            h = mix(h, v < 0 ? 0x5E7u : 0x0FFu);
            continue;
        }
        switch (f->kind) {
        case OPF_FIELD_TENSOR:
        case OPF_FIELD_TENSOR_Q: {
            const opf_tensor *t = p;
            h = t->data[0] || t->data[OPF_COMP_COL_DATA] ? hash_spec(h, &t->spec) : mix(h, 0);
            break;
        }
        case OPF_FIELD_QUANTIZER: h = mix(h, opf_quantizer_hash(p)); break;
        case OPF_FIELD_INT: h = mix(h, (uint64_t)*(const int64_t *)p); break;
        case OPF_FIELD_FLOAT: { uint64_t u; memcpy(&u, p, 8); h = mix(h, u); break; }
        case OPF_FIELD_BOOL: h = mix(h, *(const bool *)p); break;
        case OPF_FIELD_ENUM: h = mix(h, (uint64_t)*(const int *)p); break;
        case OPF_FIELD_BUNDLE: h = mix(h, f->bundle ? opf_schema_hash(f->bundle, p) : 0); break;
        case OPF_FIELD_REF: h = mix(h, (uint64_t)(uintptr_t)*(void *const *)p); break;
        default: break;
        }
    }
    return h;
}

opf_status opf_schema_validate(const opf_schema *s, const void *args)
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
        } else if (f->kind == OPF_FIELD_BUNDLE && f->bundle) {
            opf_status st = opf_schema_validate(f->bundle, p);
            if (st) return st;
        }
    }
    return OPF_OK;
}

static int print_field(const opf_field *f, const void *p, char *buf, size_t size)
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
    case OPF_FIELD_ENUM: return snprintf(buf, size, "%d", *(const int *)p);
    case OPF_FIELD_BUNDLE:
        if (!f->bundle) return snprintf(buf, size, "{}");
        opf_schema_print(f->bundle, p, buf, size);
        return (int)strlen(buf);
    case OPF_FIELD_REF: return snprintf(buf, size, "%p", *(void *const *)p);
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
        if (n < size) n += (size_t)print_field(f, field_ptr(args, f), buf + n, size - n);
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
