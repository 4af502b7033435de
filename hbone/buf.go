package hbone

import (
	"net"
	"sync"
)

// Buffers are pointers to fixed-size arrays so Put/Get do not allocate (a []byte in a
// sync.Pool is boxed on every Put).
const chunkSize = 64 << 10

var chunkPool = sync.Pool{New: func() any { return new([chunkSize]byte) }}

func getChunk() *[chunkSize]byte  { return chunkPool.Get().(*[chunkSize]byte) }
func putChunk(b *[chunkSize]byte) { chunkPool.Put(b) }

// Copy buffers used by ReadFrom grow with the stream: small for request/response traffic,
// large once bulk data is seen so each socket read becomes one large DATA frame.
var (
	copyPool16K  = sync.Pool{New: func() any { return new([16 << 10]byte) }}
	copyPool256K = sync.Pool{New: func() any { return new([256 << 10]byte) }}
	copyPool1M   = sync.Pool{New: func() any { return new([1 << 20]byte) }}
)

// bufConn buffers writes under crypto/tls so that the records of a group of frames leave
// in one write(2). The owning conn flushes it when the last queued writer releases the
// write lock. Writes larger than flushAt go out at once to bound memory.
type bufConn struct {
	net.Conn
	buffering bool // off during the handshake
	buf       []byte
}

const flushAt = 256 << 10

func (b *bufConn) Write(p []byte) (int, error) {
	if !b.buffering {
		return b.Conn.Write(p)
	}
	if len(b.buf)+len(p) > flushAt {
		if err := b.Flush(); err != nil {
			return 0, err
		}
		if len(p) > flushAt {
			return b.Conn.Write(p)
		}
	}
	b.buf = append(b.buf, p...)
	return len(p), nil
}

// Flush writes the buffered records. Called with the conn's write lock held.
func (b *bufConn) Flush() error {
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.Conn.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}
