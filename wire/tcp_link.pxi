# The TCP data path's byte transport (tcp_io.h) for Python: included by both C ends' bindings, the
# shard's (cpu_expert_service/kernels/_moe.pyx) and the GPU side's (gpu_service/experts/_tcp_client.pyx).
from libc.stdint cimport int64_t as _i64, uint64_t as _u64
from posix.unistd cimport close as _close, dup as _dup
from posix.uio cimport iovec as _iovec
import time as _time


cdef extern from "tcp_io.h" nogil:
    int TIO_OK, TIO_EOF, TIO_ERR, TIO_TIMEOUT, TIO_INTR
    ctypedef struct SSL_CTX:
        pass
    ctypedef struct TcpIo:
        int fd, err
        _u64 bytes_in, bytes_out, tls_records_out
        char why[1]
    void tio_init(TcpIo *io, int fd)
    void tio_free(TcpIo *io)
    SSL_CTX *tio_ctx(int server, const char *cert, const char *key, const char *ca, char *why, size_t cap)
    void tio_ctx_free(SSL_CTX *ctx)
    int tio_start_tls(TcpIo *io, SSL_CTX *ctx, int server, const char *host, _i64 deadline_ns)
    int tio_recv_all(TcpIo *io, unsigned char *p, size_t n, _i64 deadline_ns, int intr)
    int tio_send_all(TcpIo *io, _iovec *iov, int n, _i64 deadline_ns)
    const char *tio_version(const TcpIo *io)


cdef class TlsContext:
    """A TLS context in C over the gRPC path's files (wire.channel.TLSFiles: --tls-cert, --tls-key,
    --tls-ca): the shard's (server: the client's certificate required and checked against the CA) or
    the GPU side's (the shard's checked against the CA and its name). ValueError naming the file that
    cannot be used."""
    cdef SSL_CTX *ctx
    cdef readonly bint server

    def __cinit__(self, bint server, str cert, str key, str ca):
        cdef char why[512]
        self.server = server
        self.ctx = tio_ctx(server, cert.encode(), key.encode(), ca.encode(), why, sizeof(why))
        if self.ctx == NULL:
            raise ValueError(why.decode("utf-8", "replace"))

    def __dealloc__(self):
        tio_ctx_free(self.ctx)


cdef class Link:
    """One data connection's bytes in C: its own duplicate of fd (closed by close() or with this
    object), plaintext until start_tls(). Errors: ConnectionError, saying why and the fix."""
    cdef TcpIo io
    cdef readonly bint tls

    def __cinit__(self, int fd):
        tio_init(&self.io, -1)
        self.io.fd = _dup(fd)
        if self.io.fd < 0:
            raise OSError(f"cannot duplicate the data connection's descriptor {fd}")

    def __dealloc__(self):
        self._release()

    def close(self):
        """The TLS state freed and this end's descriptor closed (shut the socket down to end the connection)."""
        self._release()

    cdef void _release(self) noexcept:
        """close(), callable from __dealloc__."""
        if self.io.fd >= 0:
            _close(self.io.fd)
        tio_free(&self.io)
        tio_init(&self.io, -1)

    def start_tls(self, TlsContext ctx, str host, double timeout_s):
        """The TLS handshake (the socket made non-blocking), as ctx's side; host: the name or IP address
        the client checks the shard's certificate for ("" on the shard)."""
        cdef bytes h = host.encode()
        cdef const char *hp = h
        cdef int rc
        cdef _i64 end = _time.monotonic_ns() + <_i64>(timeout_s * 1e9)
        with nogil:
            rc = tio_start_tls(&self.io, ctx.ctx, ctx.server, hp, end)
        if rc != TIO_OK:
            raise ConnectionError(self._why(rc))
        self.tls = True

    def send(self, bytes data, double timeout_s):
        """All of data by timeout_s."""
        cdef _iovec v
        v.iov_base, v.iov_len = <char *>data, len(data)
        cdef int rc
        cdef _i64 end = _time.monotonic_ns() + <_i64>(timeout_s * 1e9)
        with nogil:
            rc = tio_send_all(&self.io, &v, 1, end)
        if rc != TIO_OK:
            raise ConnectionError(self._why(rc))

    def recv(self, int n, double timeout_s):
        """n bytes by timeout_s; b"" when the peer closed first."""
        cdef bytearray buf = bytearray(n)
        cdef unsigned char *p = buf
        cdef int rc
        cdef _i64 end = _time.monotonic_ns() + <_i64>(timeout_s * 1e9)
        with nogil:
            rc = tio_recv_all(&self.io, p, n, end, 0)
        if rc == TIO_EOF:
            return b""
        if rc != TIO_OK:
            raise ConnectionError(self._why(rc))
        return bytes(buf)

    @property
    def version(self):
        """The TLS protocol version ("" in plaintext)."""
        return tio_version(&self.io).decode()

    @property
    def counts(self):
        """(bytes received, bytes sent, TLS records sent) through this link."""
        return self.io.bytes_in, self.io.bytes_out, self.io.tls_records_out

    cdef str _why(self, int rc):
        """A failed transport call in words."""
        if rc == TIO_TIMEOUT:
            return self.io.why.decode("utf-8", "replace") or "the data connection did not answer in time"
        if rc == TIO_EOF:
            return self.io.why.decode("utf-8", "replace") or "the peer closed the data connection"
        if self.io.why[0]:
            return self.io.why.decode("utf-8", "replace")
        return f"the data connection failed: {os.strerror(self.io.err)}"
