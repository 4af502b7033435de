package hbone

import (
	"encoding/binary"
	"net"
	"sync"
	"sync/atomic"
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
//
// Under crypto/tls it also counts the TLS records each way from the connection's first
// byte (the handshake's few included), for the key limits (keylimit.go).
type bufConn struct {
	net.Conn
	buffering bool // off during the handshake
	count     bool // Conn carries TLS records: count them
	// mu guards buf: crypto/tls writes from the frame reader too (its answer to a peer's
	// KeyUpdate(update_requested)) holding its own lock, not the conn's write lock.
	mu     sync.Mutex
	buf    []byte
	tx, rx recordCounter // tx: under crypto/tls's write lock; rx: its read lock
	// held: the conn's write lock is held, so what is written now is flushed when it is
	// released. A write without it is crypto/tls answering a KeyUpdate from the frame
	// reader: it goes out at once (after what is buffered), or it would wait for the next
	// frame we send, up to a PING interval.
	held atomic.Bool
}

const flushAt = 256 << 10

func (b *bufConn) Read(p []byte) (int, error) {
	n, err := b.Conn.Read(p)
	if b.count {
		b.rx.add(p[:n])
	}
	return n, err
}

func (b *bufConn) Write(p []byte) (int, error) {
	if b.count {
		b.tx.add(p)
	}
	if !b.buffering {
		return b.Conn.Write(p)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.held.Load() {
		if err := b.flushLocked(); err != nil {
			return 0, err
		}
		return b.Conn.Write(p)
	}
	if len(b.buf)+len(p) > flushAt {
		if err := b.flushLocked(); err != nil {
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
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.flushLocked()
}

func (b *bufConn) flushLocked() error {
	if len(b.buf) == 0 {
		return nil
	}
	_, err := b.Conn.Write(b.buf)
	b.buf = b.buf[:0]
	return err
}

// trim drops an empty buffer grown past trimKeep.
func (b *bufConn) trim() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.buf) == 0 && cap(b.buf) > trimKeep {
		b.buf = nil
	}
}

func (b *bufConn) capacity() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return cap(b.buf)
}

// recordCounter counts the TLS records of a byte stream read from its first byte: each
// a 5-byte header (type, version, length) and length bytes. One goroutine at a time
// adds; n is read from any.
type recordCounter struct {
	n    atomic.Uint64
	hdr  [5]byte
	hoff int       // header bytes of the current record seen
	left int       // body bytes of the current record still to come
	keys *sendKeys // sent records after a TLS 1.3 handshake: told of each (keylimit.go)
}

func (r *recordCounter) add(p []byte) {
	for len(p) > 0 {
		if r.left > 0 {
			k := min(len(p), r.left)
			r.left -= k
			p = p[k:]
			continue
		}
		k := copy(r.hdr[r.hoff:], p)
		r.hoff += k
		p = p[k:]
		if r.hoff == len(r.hdr) {
			r.hoff, r.left = 0, int(binary.BigEndian.Uint16(r.hdr[3:]))
			n := r.n.Add(1)
			if r.keys != nil {
				r.keys.record(r.left, n)
			}
		}
	}
}

// copyBuf lends ReadFrom a pooled buffer sized by what the socket has been giving: 16 KiB
// for request/response traffic, one tier larger after a read that filled its buffer (bulk
// data is waiting), and back down after a read that would have fit a quarter of the tier
// below. Sizing by the bytes a stream has carried instead made a long-lived chatty
// connection borrow 1 MiB for every 1 KiB message, and the pools keep what is borrowed.
type copyBuf struct {
	cur  []byte
	tier int // 0: 16 KiB, 1: 256 KiB, 2: 1 MiB
	b16  *[16 << 10]byte
	b256 *[256 << 10]byte
	b1m  *[1 << 20]byte
}

var copyTiers = [...]int{16 << 10, 256 << 10, 1 << 20}

// get returns a buffer of the current tier, holding no other.
func (c *copyBuf) get() []byte {
	if c.cur != nil && len(c.cur) == copyTiers[c.tier] {
		return c.cur
	}
	c.release()
	switch c.tier {
	case 2:
		c.b1m = copyPool1M.Get().(*[1 << 20]byte)
		c.cur = c.b1m[:]
	case 1:
		c.b256 = copyPool256K.Get().(*[256 << 10]byte)
		c.cur = c.b256[:]
	default:
		c.b16 = copyPool16K.Get().(*[16 << 10]byte)
		c.cur = c.b16[:]
	}
	return c.cur
}

// adapt picks the next read's tier from this read's n bytes.
func (c *copyBuf) adapt(n int) {
	switch {
	case n >= copyTiers[c.tier] && c.tier < len(copyTiers)-1:
		c.tier++
	case c.tier > 0 && n <= copyTiers[c.tier-1]/4:
		c.tier--
	}
}

// release returns the buffers to their pools.
func (c *copyBuf) release() {
	if c.b16 != nil {
		copyPool16K.Put(c.b16)
		c.b16 = nil
	}
	if c.b256 != nil {
		copyPool256K.Put(c.b256)
		c.b256 = nil
	}
	if c.b1m != nil {
		copyPool1M.Put(c.b1m)
		c.b1m = nil
	}
	c.cur = nil
}

// recvBuf is a queue of pooled chunks holding received, unread data.
type recvBuf struct {
	chunks []*[chunkSize]byte
	r, w   int // read offset in chunks[0], write offset in the last chunk
	n      int
}

func (b *recvBuf) write(p []byte) {
	for len(p) > 0 {
		if len(b.chunks) == 0 || b.w == chunkSize {
			b.chunks = append(b.chunks, getChunk())
			b.w = 0
		}
		k := copy(b.chunks[len(b.chunks)-1][b.w:], p)
		b.w += k
		b.n += k
		p = p[k:]
	}
}

func (b *recvBuf) peek() []byte {
	if b.n == 0 {
		return nil
	}
	end := chunkSize
	if len(b.chunks) == 1 {
		end = b.w
	}
	return b.chunks[0][b.r:end]
}

func (b *recvBuf) advance(k int) {
	b.r += k
	b.n -= k
	if len(b.chunks) == 1 && b.r == b.w {
		putChunk(b.chunks[0])
		b.chunks[0] = nil
		b.chunks = b.chunks[:0]
		b.r, b.w = 0, 0
	} else if b.r == chunkSize {
		putChunk(b.chunks[0])
		copy(b.chunks, b.chunks[1:])
		b.chunks[len(b.chunks)-1] = nil
		b.chunks = b.chunks[:len(b.chunks)-1]
		b.r = 0
	}
}

func (b *recvBuf) read(p []byte) int {
	total := 0
	for len(p) > 0 && b.n > 0 {
		k := copy(p, b.peek())
		b.advance(k)
		p = p[k:]
		total += k
	}
	return total
}

func (b *recvBuf) free() {
	for i, ch := range b.chunks {
		putChunk(ch)
		b.chunks[i] = nil
	}
	b.chunks = b.chunks[:0]
	b.r, b.w, b.n = 0, 0, 0
}
