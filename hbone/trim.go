package hbone

// Giving a connection's bulk buffers back once it goes idle. A connection that carried a
// 1 MiB DATA frame keeps the Framer's read buffer at 1 MiB (x/net allocates it and keeps
// it), and one that sent bulk data keeps its coalescing buffer at up to 320 KiB: about
// 1.3 MiB per side, for as long as the pool keeps the connection. Once such a connection
// has carried nothing for a whole trimTick, writeLoop drops those buffers: the write
// side's under the write lock, the read side's by interrupting the frame reader between
// two frames (a read deadline in the past; crypto/tls and the kernel TLS conn both take
// a timeout as nothing read), which then starts a fresh read Framer. A connection that
// never grows past trimKeep is never trimmed, so request/response traffic pays nothing;
// bulk traffic with idle gaps pays one reallocation per burst.

import (
	"errors"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/net/http2"
)

// trimKeep is the largest buffer a connection keeps while idle: a read buffer for one
// 16 KiB frame, or the coalescing buffer of a few records.
const trimKeep = 64 << 10

// trimTick is how often writeLoop looks for a grown connection going idle: its buffers go
// back between one and two ticks after its last frame.
const trimTick = 500 * time.Millisecond

// errTrim is what frameReader returns to the read Framer, between frames, when writeLoop
// has asked for the read buffer back.
var errTrim = errors.New("hbone: trimming the read buffer")

// frameReader is what the read Framer reads from on the user-space path. It follows the
// frames passing through it so that the frame reader is interrupted for a trim only
// between two frames, never inside one (a lost header byte would corrupt the stream).
//
// It is the frame reader's alone.
type frameReader struct {
	c    *conn
	r    io.Reader
	hdr  [9]byte
	hoff int // header bytes of the current frame read
	pass int // payload bytes of the current frame still to read
}

func (f *frameReader) Read(p []byte) (int, error) {
	for {
		if f.hoff == 0 && f.pass == 0 && f.c.trimRead.Load() && f.c.trimRead.Swap(false) {
			return 0, errTrim // between frames
		}
		if f.hoff < len(f.hdr) && f.pass == 0 {
			p = p[:min(len(p), len(f.hdr)-f.hoff)]
		} else {
			p = p[:min(len(p), f.pass)]
		}
		n, err := f.r.Read(p)
		if f.hoff < len(f.hdr) {
			f.hoff += copy(f.hdr[f.hoff:], p[:n])
			if f.hoff == len(f.hdr) {
				f.pass = int(f.hdr[0])<<16 | int(f.hdr[1])<<8 | int(f.hdr[2])
				f.c.frameRead(f.pass)
			}
		} else {
			f.pass -= n
		}
		if f.hoff == len(f.hdr) && f.pass == 0 {
			f.hoff = 0 // the frame is whole
		}
		if err != nil && f.c.readInterrupted(err) {
			if n == 0 {
				continue // trim at the frame's end, if inside one
			}
			err = nil
		}
		return n, err
	}
}

// frameRead notes one frame header read, with its payload length: activity for the
// idle check, and a read buffer grown past trimKeep.
func (c *conn) frameRead(n int) {
	c.activity.Add(1)
	if int64(n) > c.readMax.Load() {
		c.readMax.Store(int64(n))
		if n > trimKeep && !c.readGrown.Load() {
			c.readGrown.Store(true)
			c.kickWriter()
		}
	}
}

// readInterrupted reports whether err is a read deadline, which on the frame reader's
// connection only trimIfIdle sets (after the handshake nothing else does), and if so
// clears it: the frame reader trims at the next frame boundary and reads on.
func (c *conn) readInterrupted(err error) bool {
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		return false
	}
	c.readConn().SetReadDeadline(time.Time{})
	return true
}

// readConn is the connection the frame reader reads from.
func (c *conn) readConn() net.Conn {
	if c.kt.conn != nil {
		return c.kt.conn
	}
	return c.nc
}

// newReadFramer makes the frame reader's Framer; the HPACK decoder carries over, with
// its dynamic table.
func (c *conn) newReadFramer() {
	c.rfr = http2.NewFramer(nil, c.src)
	c.rfr.SetMaxReadFrameSize(c.cfg.MaxFrameSize)
	c.rfr.SetReuseFrames()
	c.rfr.ReadMetaHeaders = c.hdec
	if c.server {
		c.rfr.MaxHeaderListSize = serverMaxHeaders
	} else {
		c.rfr.MaxHeaderListSize = clientMaxHeaders
	}
}

// kickWriter wakes writeLoop.
func (c *conn) kickWriter() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}

// noteWriteGrown marks a write-side buffer grown past trimKeep (wmu held).
//
//go:noinline
func (c *conn) noteWriteGrown() {
	if !c.writeGrown.Load() {
		c.writeGrown.Store(true)
		c.kickWriter()
	}
}

// grown reports whether some buffer of the connection is past trimKeep.
func (c *conn) grown() bool { return c.readGrown.Load() || c.writeGrown.Load() }

// trimIfIdle gives the grown buffers back if nothing was read or written since the last
// tick (whose activity count is *last), and reports whether it did.
func (c *conn) trimIfIdle(last *uint64) bool {
	if now := c.activity.Load(); now != *last {
		*last = now
		return false
	}
	if c.readGrown.Swap(false) {
		c.trimRead.Store(true)
		c.readConn().SetReadDeadline(time.Unix(1, 0))
	}
	if c.writeGrown.Swap(false) {
		c.lockWrite()
		if c.bc != nil {
			c.bc.trim()
		}
		if c.bigWrites {
			c.bigWrites = false
			c.fr = http2.NewFramer(c.nc, nil)
		}
		c.unlockWrite()
	}
	return true
}

// retainedBuffers reports the bytes of the connection's own buffers: the read Framer's
// buffer (the largest frame it read), the write Framer's and the coalescing buffer.
// crypto/tls's record buffers are not counted (it does not say).
func (c *conn) retainedBuffers() int {
	n := int(c.readMax.Load())
	c.wmu.Lock() // not lockWrite: that counts as activity
	if c.bc != nil {
		n += c.bc.capacity()
	}
	if c.bigWrites {
		n += int(c.cfg.MaxFrameSize)
	}
	c.wmu.Unlock()
	return n
}
