package hbone

// The frame reader's source on a kernel TLS connection: DATA payloads for a DeliverTo
// socket move kernel TLS socket → pipe → socket by splice(2), never through user space.

import (
	"encoding/binary"
	"io"
	"syscall"

	"github.com/gozt/gozt/internal/ktls"
	"golang.org/x/net/http2"
)

// spliceRecv enables kernelReader's splicing; a variable so tests and benchmarks can
// compare both paths.
var spliceRecv = true

// kernelReader is what the Framer reads from on a kernel TLS connection. It reads each
// frame header itself, exactly (never into the next payload): a DATA frame for a stream
// whose consumer is a DeliverTo socket with nothing queued it takes whole (spliceData),
// every other frame it hands to the Framer, header and payload.
//
// It is the frame reader's alone.
type kernelReader struct {
	c         *conn
	hdr       [9]byte
	hn        int  // header bytes read
	hoff      int  // header bytes handed to the Framer
	pass      int  // payload bytes of the current frame still to hand to the Framer
	busy      bool // a frame is being handed to the Framer
	inHeaders bool // inside a header block: only CONTINUATION may follow, so no splicing
	sp        *ktls.Splicer
	noPipe    bool // no pipe could be made: do not splice

	// The poll callbacks and their arguments and results (made once: a closure per
	// splice would allocate).
	fillFn, drainFn func(fd uintptr) bool
	want, got       int
	moved           int
	err             error
}

func newKernelReader(c *conn) *kernelReader {
	k := &kernelReader{c: c, hoff: 9}
	k.fillFn, k.drainFn = k.fill, k.drain
	return k
}

func (k *kernelReader) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	for !k.busy {
		for k.hn < len(k.hdr) {
			if k.hn == 0 && k.c.trimRead.Load() && k.c.trimRead.Swap(false) {
				return 0, errTrim // between frames: trim.go
			}
			n, err := k.c.kt.conn.Read(k.hdr[k.hn:])
			k.hn += n
			if err != nil && !k.c.readInterrupted(err) {
				return 0, err
			}
		}
		k.hn = 0
		n := int(k.hdr[0])<<16 | int(k.hdr[1])<<8 | int(k.hdr[2])
		k.c.frameRead(n)
		typ, flags := http2.FrameType(k.hdr[3]), http2.Flags(k.hdr[4])
		if typ == http2.FrameData && flags&http2.FlagDataPadded == 0 && n > 0 && !k.inHeaders && spliceRecv {
			id := binary.BigEndian.Uint32(k.hdr[5:]) & (1<<31 - 1)
			took, err := k.spliceData(id, flags&http2.FlagDataEndStream != 0, n)
			if err != nil {
				return 0, err
			}
			if took {
				continue
			}
		}
		switch typ {
		case http2.FrameHeaders, http2.FramePushPromise, http2.FrameContinuation:
			k.inHeaders = flags&http2.FlagHeadersEndHeaders == 0 // the same bit for all three
		}
		k.busy, k.hoff, k.pass = true, 0, n
	}
	if k.hoff < len(k.hdr) {
		n := copy(p, k.hdr[k.hoff:])
		k.hoff += n
		k.busy = k.hoff < len(k.hdr) || k.pass > 0
		return n, nil
	}
	n, err := k.c.kt.conn.Read(p[:min(len(p), k.pass)])
	k.pass -= n
	k.busy = k.pass > 0
	if err != nil && k.c.readInterrupted(err) {
		if n == 0 {
			return k.Read(p) // inside a frame: finish it first
		}
		err = nil
	}
	return n, err
}

// close returns the pipe; the frame reader has stopped.
func (k *kernelReader) close() {
	putPipe(k.sp)
	k.sp = nil
}

// spliceData takes one DATA frame (header read, payload still in the socket) if its
// stream can take it straight to its DeliverTo socket, and reports whether it did. What
// the socket does not take at once is read into the stream's queue (the frame reader
// never waits for a socket's write side), as writeDirectLocked does.
func (k *kernelReader) spliceData(id uint32, end bool, n int) (bool, error) {
	c := k.c
	if k.sp == nil {
		if k.noPipe {
			return false, nil
		}
		sp, err := getPipe()
		if err != nil {
			k.noPipe = true
			return false, nil
		}
		k.sp = sp
	}
	c.mu.Lock()
	s := c.streams[id]
	if !c.gotSettings || s == nil || s.sink == nil || s.rb.n != 0 || s.readBusy || s.recvEnd || s.localClosed ||
		(!c.server && !s.gotResp) || int64(n) > c.recvConnAvail || int64(n) > s.recvAvail || n > int(c.cfg.MaxFrameSize) {
		c.mu.Unlock()
		return false, nil // the Framer and handleData take it, checks and errors included
	}
	c.recvConnAvail -= int64(n)
	s.recvAvail -= int64(n)
	s.readBusy = true // WriteTo and drains stay out, as for writeDirectLocked
	sink := s.sink
	c.mu.Unlock()

	spliced, rest, err := k.splicePayload(sink, n)

	c.mu.Lock()
	s.readBusy = false
	if spliced > 0 {
		s.directTotal += int64(spliced)
		c.consumedLocked(s, spliced)
	}
	if s.waitBusy {
		s.waitBusy = false
		s.cond.Broadcast()
	}
	c.mu.Unlock()
	c.kt.splicedIn.Add(int64(spliced))
	if err == nil && rest > 0 {
		err = k.queueRest(s, rest)
	}
	if err != nil {
		return true, err
	}
	var finish *Stream
	c.mu.Lock()
	if end && !s.localClosed {
		s.recvEnd = true
		c.maybeDoneLocked(s)
		if s.deliverDone != nil && !s.delivering && s.rb.n == 0 {
			s.delivering = true // so signalLocked starts no drain goroutine
			finish = s
		}
		s.signalLocked()
	}
	c.mu.Unlock()
	if finish != nil {
		finish.drain()
	}
	return true, nil
}

// splicePayload moves up to n payload bytes to sink while it takes them without waiting.
// It returns the bytes sink took and those left (in the pipe, then in the socket).
func (k *kernelReader) splicePayload(sink syscall.RawConn, n int) (spliced, rest int, err error) {
	rc, _ := k.c.kt.conn.SyscallConn()
	left := n
	for left > 0 {
		k.want = left
		if err := rc.Read(k.fillFn); err != nil {
			if k.c.readInterrupted(err) {
				continue // inside a frame: finish it first
			}
			return spliced, left, err
		}
		if k.err == ktls.ErrNotData {
			return spliced, left, nil // a control record inside the payload: Read handles it
		}
		if k.err == io.EOF {
			return spliced, left, io.ErrUnexpectedEOF
		}
		if k.err != nil {
			return spliced, left, k.err
		}
		left -= k.got
		k.moved = 0
		sink.Write(k.drainFn) // a failed write leaves the bytes for the queue, whose drain reports it
		spliced += k.moved
		if k.sp.Buffered() > 0 {
			return spliced, left + k.sp.Buffered(), nil
		}
	}
	return spliced, 0, nil
}

// fill moves up to k.want bytes into the pipe, as many records as the socket has ready.
func (k *kernelReader) fill(fd uintptr) bool {
	k.got, k.err = 0, nil
	for k.got < k.want {
		n, err := k.sp.FillFD(int(fd), k.want-k.got)
		k.got += n
		if err == syscall.EAGAIN && k.got > 0 {
			return true
		}
		if err != nil {
			if k.got == 0 || err != ktls.ErrNotData {
				k.err = err
			}
			return err != syscall.EAGAIN
		}
	}
	return true
}

// drain moves what the pipe holds to the sink, until the sink is full.
func (k *kernelReader) drain(fd uintptr) bool {
	for k.sp.Buffered() > 0 {
		m, err := k.sp.DrainFD(int(fd), k.sp.Buffered())
		k.moved += m
		if err != nil {
			break
		}
	}
	return true
}

// queueRest reads the rest of a spliced frame's payload (the pipe's, then the socket's)
// into the stream's queue, or drops it if the stream was closed meanwhile.
func (k *kernelReader) queueRest(s *Stream, rest int) error {
	c := k.c
	buf := getChunk()
	defer putChunk(buf)
	for rest > 0 {
		var n int
		var err error
		if k.sp.Buffered() > 0 {
			n, err = k.sp.Read(buf[:min(rest, k.sp.Buffered(), len(buf))])
		} else {
			n, err = c.kt.conn.Read(buf[:min(rest, len(buf))])
			if n == 0 && err != nil && c.readInterrupted(err) {
				continue // inside a frame: finish it first
			}
		}
		if n == 0 {
			if err == nil || err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return err
		}
		rest -= n
		c.kt.copiedIn.Add(int64(n))
		c.mu.Lock()
		if s.localClosed {
			c.releaseConnLocked(int64(n))
		} else {
			s.rb.write(buf[:n])
			s.signalLocked()
		}
		c.mu.Unlock()
	}
	return nil
}
