//go:build linux

package ktls

import (
	"errors"
	"fmt"
	"io"
	"syscall"

	"golang.org/x/sys/unix"
)

// pipeSize is asked of the kernel for a Splicer's pipe (F_SETPIPE_SZ), as Go's own splice
// does; without it a pipe holds 64 KiB.
const pipeSize = 1 << 20

// ErrNotData is Fill's error when the next record on a kernel TLS socket is not
// application data (the kernel's splice_read refuses it with EINVAL): Read it instead,
// which reports what it is.
var ErrNotData = errors.New("ktls: splice: next record is not application data")

// Splicer moves bytes from one socket to another through a pipe it owns, with splice(2),
// so they never cross user space: TCP socket → pipe → kernel TLS socket, which encrypts
// them, or kernel TLS socket (decrypted) → pipe → TCP socket.
//
// One goroutine uses a Splicer at a time. Fill and Drain alternate: Fill moves what a
// source has (up to a limit) into the empty pipe and says how much that was; Drain moves
// all of it out. Between them the caller knows the payload's length, which is what an
// HBONE writer needs to frame it:
//
//	n, err := s.Fill(tcp, maxFrame)          // payload now in the pipe
//	hdr := http2FrameHeader(n, DATA, stream) // 9 bytes
//	kc.WriteMore(hdr[:])                     // MSG_MORE: the record stays open
//	_, err = s.Drain(kc, false)              // the payload joins the header's record
//
// The header must go out after Fill and before Drain, on the goroutine that holds the
// connection's write lock for the whole frame. The other way, a reader Reads the 9-byte
// header from the Conn, then calls Fill(kc, remaining) and Drain(tcp, ...) until the
// frame's payload is through.
type Splicer struct {
	r, w int // the pipe's read and write ends, non-blocking
	n    int // bytes in the pipe
}

// NewSplicer opens the pipe.
func NewSplicer() (*Splicer, error) {
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("ktls: pipe: %w", err)
	}
	_, _ = unix.FcntlInt(uintptr(p[1]), unix.F_SETPIPE_SZ, pipeSize) // best effort: may exceed pipe-max-size
	return &Splicer{r: p[0], w: p[1]}, nil
}

// Buffered is the number of bytes in the pipe.
func (s *Splicer) Buffered() int { return s.n }

// Fill waits until src has data and moves up to max bytes of it into the pipe, which must
// be empty (so that EAGAIN can only mean src has nothing yet). It returns the bytes moved,
// or io.EOF at the end of src's stream.
func (s *Splicer) Fill(src syscall.Conn, max int) (int, error) {
	if s.n != 0 {
		return 0, fmt.Errorf("ktls: splice: Fill with %d bytes still in the pipe", s.n)
	}
	if max <= 0 {
		return 0, nil
	}
	rc, err := src.SyscallConn()
	if err != nil {
		return 0, err
	}
	var n int
	var serr error
	if err := rc.Read(func(fd uintptr) bool {
		n, serr = splice(int(fd), s.w, max, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
		return serr != unix.EAGAIN
	}); err != nil {
		return 0, err
	}
	switch {
	case serr == unix.EINVAL:
		return 0, ErrNotData
	case serr != nil:
		return 0, fmt.Errorf("ktls: splice from socket: %w", serr)
	case n == 0:
		return 0, io.EOF
	}
	s.n = n
	return n, nil
}

// FillFD is Fill for a caller inside src's own RawConn.Read callback, fd being src's: one
// splice that does not wait, so it returns syscall.EAGAIN when src has nothing yet (the
// caller can let go of the Splicer before it waits) or the pipe is full. Unlike Fill it
// may add to a pipe that holds bytes: a kernel TLS socket splices one record per call.
func (s *Splicer) FillFD(fd, max int) (int, error) {
	n, err := splice(fd, s.w, max, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
	switch {
	case err == unix.EAGAIN:
		return 0, syscall.EAGAIN
	case err == unix.EINVAL:
		return 0, ErrNotData
	case err != nil:
		return 0, fmt.Errorf("ktls: splice from socket: %w", err)
	case n == 0:
		return 0, io.EOF
	}
	s.n += n
	return n, nil
}

// Drain moves everything in the pipe to dst, waiting while dst's send buffer is full.
// more passes SPLICE_F_MORE (MSG_MORE): more data follows at once, so a kernel TLS socket
// keeps the last record open for it.
func (s *Splicer) Drain(dst syscall.Conn, more bool) (int, error) {
	return s.DrainN(dst, s.n, more)
}

// DrainN is Drain for the first n bytes in the pipe (at most Buffered); the rest stay for
// a later DrainN, Drain or Read.
func (s *Splicer) DrainN(dst syscall.Conn, n int, more bool) (int, error) {
	rc, err := dst.SyscallConn()
	if err != nil {
		return 0, err
	}
	flags := unix.SPLICE_F_MOVE | unix.SPLICE_F_NONBLOCK
	if more {
		flags |= unix.SPLICE_F_MORE
	}
	left := min(n, s.n)
	total := 0
	var serr error
	err = rc.Write(func(fd uintptr) bool {
		for left > 0 {
			var k int
			k, serr = splice(s.r, int(fd), left, flags)
			if serr != nil {
				return serr != unix.EAGAIN
			}
			s.n -= k
			left -= k
			total += k
		}
		return true
	})
	if err == nil && serr != nil {
		err = fmt.Errorf("ktls: splice to socket: %w", serr)
	}
	return total, err
}

// DrainFD is DrainN for a caller inside dst's RawConn.Write callback, fd being dst's: one
// non-blocking splice, so it may move fewer than n bytes, or none with syscall.EAGAIN.
func (s *Splicer) DrainFD(fd, n int) (int, error) {
	k, err := splice(s.r, fd, min(n, s.n), unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
	if err != nil {
		if err == unix.EAGAIN {
			return 0, syscall.EAGAIN
		}
		return 0, fmt.Errorf("ktls: splice to socket: %w", err)
	}
	s.n -= k
	return k, nil
}

// Read copies up to len(p) bytes out of the pipe into p: for what a full destination did
// not take.
func (s *Splicer) Read(p []byte) (int, error) {
	if s.n == 0 {
		return 0, io.EOF
	}
	n, err := unix.Read(s.r, p[:min(len(p), s.n)])
	if err != nil {
		return 0, fmt.Errorf("ktls: read pipe: %w", err)
	}
	s.n -= n
	return n, nil
}

// Close closes the pipe; bytes still in it are lost.
func (s *Splicer) Close() error {
	err := unix.Close(s.r)
	if err2 := unix.Close(s.w); err == nil {
		err = err2
	}
	s.r, s.w, s.n = -1, -1, 0
	return err
}

func splice(from, to, n, flags int) (int, error) {
	m, err := unix.Splice(from, nil, to, nil, n, flags)
	return int(m), err
}
