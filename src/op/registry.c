/* registry.c: the op-class registry, keyed by lower-case name. */
#include <ctype.h>
#include <pthread.h>
#include <string.h>

#include "core/core-impl.h"
#include "op/op-impl.h"

enum { MAX_CLASSES = 256 };

static const opf_op_class *classes[MAX_CLASSES];
static int n_classes;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t builtins_once = PTHREAD_ONCE_INIT;

static bool lower_name(const char *s)
{
    if (!s || !*s) return false;
    for (; *s; s++)
        if (!(islower((unsigned char)*s) || isdigit((unsigned char)*s) || *s == '_')) return false;
    return true;
}

static const opf_op_class *find_locked(const char *name)
{
    for (int i = 0; i < n_classes; i++)
        if (!strcmp(classes[i]->name, name)) return classes[i];
    return NULL;
}

static opf_status check_class(const opf_op_class *c)
{
    const char *fn = "opf_op_class_register";
    if (c->abi_version != OPF_OP_ABI_VERSION)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: class \"%s\" has abi_version %d, want %d",
                         fn, c->name ? c->name : "?", c->abi_version, OPF_OP_ABI_VERSION);
    if (!lower_name(c->name))
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "%s: class name \"%s\" must be non-empty lower-case [a-z0-9_]", fn,
                         c->name ? c->name : "(null)");
    if (c->covers < 0 || c->covers > OPF_FUSED_MAX)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: class \"%s\" covers %d ops (0..%d)", fn,
                         c->name, c->covers, OPF_FUSED_MAX);
    if (c->covers == 0 && (!c->fwd_schema || !c->resolve_fwd || !c->forward_impl))
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "%s: class \"%s\" needs fwd_schema, resolve_fwd and forward_impl", fn,
                         c->name);
    if (c->covers > 0 && !c->forward_impl && !c->backward_impl)
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "%s: fused class \"%s\" has neither a forward nor a backward", fn, c->name);
    if (c->forward_impl && (!c->fwd_schema || !c->resolve_fwd))
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "%s: class \"%s\" has forward_impl but no fwd_schema/resolve_fwd", fn, c->name);
    if ((c->fwd_schema && c->fwd_schema->size > OPF_OP_ARGS_MAX) || (c->bwd_schema && c->bwd_schema->size > OPF_OP_ARGS_MAX))
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: class \"%s\" args exceed %d bytes", fn,
                         c->name, OPF_OP_ARGS_MAX);
    if (c->backward_impl && (!c->bwd_schema || !c->resolve_bwd))
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "%s: class \"%s\" has backward_impl but no bwd_schema/resolve_bwd", fn,
                         c->name);
    if (c->n_extra_in < 0 || c->n_extra_in > OPF_OP_MAX_EXTRA || c->n_extra_out < 0 ||
        c->n_extra_out > OPF_OP_MAX_EXTRA)
        return opf_error(NULL, OPF_ERR_INVALID_ARG, "%s: class \"%s\" extra in/out %d/%d > %d", fn,
                         c->name, c->n_extra_in, c->n_extra_out, OPF_OP_MAX_EXTRA);
    return OPF_OK;
}

static opf_status register_locked(const opf_op_class *cls)
{
    if (find_locked(cls->name))
        return opf_error(NULL, OPF_ERR_INVALID_ARG,
                         "opf_op_class_register: \"%s\" is already registered", cls->name);
    if (n_classes == MAX_CLASSES)
        return opf_error(NULL, OPF_ERR_NO_MEMORY, "opf_op_class_register: %d classes at most",
                         MAX_CLASSES);
    classes[n_classes++] = cls;
    return OPF_OK;
}

static void register_builtins(void) { opf_ops_register_builtins(); }

/* For builtins: called under pthread_once, before anyone else can register. */
opf_status opf_op_class_register_builtin(const opf_op_class *cls)
{
    opf_status st = check_class(cls);
    return st ? st : register_locked(cls);
}

opf_status opf_op_class_register(const opf_op_class *cls)
{
    OPF_CHECK_NULL(NULL, "opf_op_class_register", cls);
    pthread_once(&builtins_once, register_builtins);
    opf_status st = check_class(cls);
    if (st) return st;
    pthread_mutex_lock(&lock);
    st = register_locked(cls);
    pthread_mutex_unlock(&lock);
    return st;
}

const opf_op_class *opf_op_class_find(const char *name)
{
    if (!name) return NULL;
    pthread_once(&builtins_once, register_builtins);
    pthread_mutex_lock(&lock);
    const opf_op_class *c = find_locked(name);
    pthread_mutex_unlock(&lock);
    return c;
}

int opf_op_class_count(void)
{
    pthread_once(&builtins_once, register_builtins);
    pthread_mutex_lock(&lock);
    int n = n_classes;
    pthread_mutex_unlock(&lock);
    return n;
}

const opf_op_class *opf_op_class_at(int i)
{
    pthread_once(&builtins_once, register_builtins);
    pthread_mutex_lock(&lock);
    const opf_op_class *c = i >= 0 && i < n_classes ? classes[i] : NULL;
    pthread_mutex_unlock(&lock);
    return c;
}
