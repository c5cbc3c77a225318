# A call's arrays as both GPU-side C clients take them (_shm_client.pyx and _tcp_client.pyx include this).

cdef int check_call(cnp.ndarray h, cnp.ndarray ids, cnp.ndarray w, int H, int wire) except -1:
    """h [T, H] C-contiguous float32 or a 16-bit wire dtype (wire 1 or 2), ids [T, k] int64, w [T, k]
    float32, all C-contiguous; else ValueError naming what came. Returns 1 when h is already in the
    wire dtype (no cast needed), else 0."""
    cdef int T = h.shape[0], k = ids.shape[1]
    if (h.ndim != 2 or ids.ndim != 2 or w.ndim != 2 or h.shape[1] != H or ids.shape[0] != T
            or w.shape[0] != T or w.shape[1] != k or cnp.PyArray_TYPE(ids) != cnp.NPY_INT64
            or cnp.PyArray_TYPE(w) != cnp.NPY_FLOAT32
            or (cnp.PyArray_TYPE(h) != cnp.NPY_FLOAT32 and (wire == 0 or cnp.PyArray_ITEMSIZE(h) != 2))
            or not (cnp.PyArray_IS_C_CONTIGUOUS(h) and cnp.PyArray_IS_C_CONTIGUOUS(ids)
                    and cnp.PyArray_IS_C_CONTIGUOUS(w))):
        a, b, c = <object>h, <object>ids, <object>w
        raise ValueError(f"send: expected C-contiguous h [T, {H}] float32 or the wire dtype, ids [T, k] "
                         f"int64, w [T, k] float32; got {a.dtype}{a.shape}, {b.dtype}{b.shape}, {c.dtype}{c.shape}")
    return 1 if cnp.PyArray_ITEMSIZE(h) == 2 or wire == 0 else 0
