/* dlpack.h: the DLPack exchange structs (the unversioned "dltensor"
 * capsule of the DLPack specification), declared here so the extension
 * needs no outside header. Type codes follow the specification's
 * DLDataTypeCode numbering. */
#ifndef OPF_PYEXT_DLPACK_H
#define OPF_PYEXT_DLPACK_H

#include <stdint.h>

enum {
    OPF_DL_CPU = 1,
    OPF_DL_CUDA = 2,
    OPF_DL_CUDA_HOST = 3,
};

enum {
    OPF_DL_INT = 0,
    OPF_DL_UINT = 1,
    OPF_DL_FLOAT = 2,
    OPF_DL_BFLOAT = 4,
    OPF_DL_BOOL = 6,
    OPF_DL_F8_E4M3FN = 10,
    OPF_DL_F8_E5M2 = 12,
    OPF_DL_F8_E8M0FNU = 14,
};

typedef struct {
    int32_t device_type;
    int32_t device_id;
} opf_dl_device;

typedef struct {
    uint8_t  code;
    uint8_t  bits;
    uint16_t lanes;
} opf_dl_dtype;

typedef struct {
    void         *data;
    opf_dl_device device;
    int32_t       ndim;
    opf_dl_dtype  dtype;
    int64_t      *shape;
    int64_t      *strides;   /* in elements; NULL = compact row-major */
    uint64_t      byte_offset;
} opf_dl_tensor;

typedef struct opf_dl_managed {
    opf_dl_tensor dl_tensor;
    void         *manager_ctx;
    void        (*deleter)(struct opf_dl_managed *self);
} opf_dl_managed;

/* The versioned capsule ("dltensor_versioned", DLPack >= 1.0): consumers
 * that ask for it (max_version >= (1, 0)) get a writable view. */
typedef struct opf_dl_managed_v {
    struct {
        uint32_t major, minor;
    } version;
    void    *manager_ctx;
    void   (*deleter)(struct opf_dl_managed_v *self);
    uint64_t flags;
    opf_dl_tensor dl_tensor;
} opf_dl_managed_v;

#endif
