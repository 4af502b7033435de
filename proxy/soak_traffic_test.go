package proxy_test

// The soak's traffic (soak_test.go runs it): what the client and the backend of each
// soakKind do, and how a connection's end is judged.

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"
)

// soakClient runs one connection of plan p to host:port through the SOCKS5 proxy.
func soakClient(socks, host string, port uint16, p chaosPlan) soakResult {
	r := soakResult{plan: p, start: time.Now()}
	defer func() { r.end = time.Now() }()
	k := soakKind(p.kind)
	c, err := net.DialTimeout("tcp", socks, 5*time.Second)
	if err != nil {
		r.outcome, r.err = failHandshake, err
		return r
	}
	tc := c.(*net.TCPConn)
	defer tc.Close()
	r.local = tc.LocalAddr().String()
	code, err := socksHandshake(tc, host, port)
	if err != nil || code != repSucceeded {
		r.err = fmt.Errorf("socks5: reply %d: %v", code, err)
		switch {
		case err == nil && k == soakGone:
			r.outcome = outDesigned
		case err == nil:
			r.outcome = failRefused
		default:
			r.outcome = failHandshake
		}
		r.end = time.Now()
		return r
	}
	_ = c.SetDeadline(r.start.Add(soakDeadline(k)))
	if k == soakGone {
		r.outcome, r.err = failWrong, errors.New("connected to a port nothing listens on")
		return r
	}
	err = soakClientRun(tc, k, p)
	r.end = time.Now()
	switch {
	case err == nil:
		r.outcome = outOK
		if k == soakClientAbort || k == soakBackendReset || k == soakStall || k == soakHalfOpen || k == soakIdle {
			r.outcome = outDesigned
		}
	case errors.Is(err, errWrongBytes):
		r.outcome = failWrong
	case errors.Is(err, os.ErrDeadlineExceeded):
		r.outcome = failTimeout
	default:
		r.outcome = failCut
	}
	r.err = err
	return r
}

var errShort = errors.New("stream ended early")

// soakClientRun plays the client's side of kind k and returns the first problem.
func soakClientRun(c *net.TCPConn, k soakKind, p chaosPlan) error {
	i := uint64(p.index)
	switch k {
	case soakEcho:
		return echoCheck(c, payload(upSeed(i), p.a), upSeed(i), p.a)

	case soakLong:
		return echoCheck(c, paced{r: payload(upSeed(i), p.a), every: p.pause / time.Duration(p.a/(16<<10)+1)}, upSeed(i), p.a)

	case soakServerFirst, soakBigDown, soakBigUp:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		if n, err := readPattern(c, downSeed(i), p.a); err != nil {
			return err
		} else if n != p.a {
			return fmt.Errorf("%w: %d of %d bytes before the backend's FIN", errShort, n, p.a)
		}
		if _, err := io.Copy(c, payload(upSeed(i), p.b)); err != nil {
			return err
		}
		if err := c.CloseWrite(); err != nil {
			return err
		}
		// The backend closes once it has checked every byte: a clean EOF says it did.
		var one [1]byte
		if n, err := c.Read(one[:]); err != io.EOF {
			return fmt.Errorf("%w: after our FIN: %d bytes, %v; want EOF", errShort, n, err)
		}
		return nil

	case soakClientAbort:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		if _, err := io.Copy(c, payload(upSeed(i), p.a)); err != nil {
			return err
		}
		_ = c.SetLinger(0)
		return nil

	case soakBackendReset:
		// Send until the backend's reset ends the connection; it must end, and promptly.
		werr := make(chan error, 1)
		go func() {
			_, err := c.Write(header(p))
			if err == nil {
				_, err = io.Copy(c, payload(upSeed(i), chaosEndless))
			}
			werr <- err
		}()
		_, rerr := readPattern(c, downSeed(i), 0)
		if rerr != nil && !errors.Is(rerr, syscall.ECONNRESET) {
			c.Close()
		}
		err := <-werr
		switch {
		case errors.Is(rerr, os.ErrDeadlineExceeded), errors.Is(rerr, errWrongBytes):
			return rerr
		case errors.Is(err, os.ErrDeadlineExceeded):
			return err
		case err == nil:
			return fmt.Errorf("wrote %d bytes to a backend that resets after %d", chaosEndless, p.a)
		}
		return nil

	case soakStall:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		_ = c.SetReadDeadline(time.Now().Add(p.pause))
		var one [1]byte
		n, err := c.Read(one[:])
		if err == io.EOF {
			return fmt.Errorf("%w: stalled backend: EOF; want nothing", errShort)
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("stalled backend: read %d bytes, %v; want nothing", n, err)
		}
		_ = c.SetLinger(0)
		return nil

	case soakHalfOpen:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		time.Sleep(p.pause) // read nothing: the backend's writes back up to it
		_ = c.SetLinger(0)
		return nil

	case soakIdle:
		time.Sleep(p.pause)
		return nil
	}
	return fmt.Errorf("kind %v", k)
}

// echoCheck sends src (size bytes of seed's pattern), half-closes, and reads the same
// bytes back to EOF.
func echoCheck(c *net.TCPConn, src io.Reader, seed uint64, size int64) error {
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, src)
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	n, rerr := readPattern(c, seed, size)
	if rerr != nil || n != size {
		c.Close() // unblock the writer
	}
	werr2 := <-werr
	switch {
	case rerr != nil:
		return rerr
	case n != size:
		return fmt.Errorf("%w: echo %d of %d bytes", errShort, n, size)
	case werr2 != nil:
		return werr2
	}
	return nil
}

// paced reads 16 KiB at a time with a pause before each read: a connection that lasts.
type paced struct {
	r     io.Reader
	every time.Duration
}

func (p paced) Read(b []byte) (int, error) {
	time.Sleep(p.every)
	return p.r.Read(b[:min(len(b), 16<<10)])
}

// soakBackend plays the backend's side of kind k.
func soakBackend(k soakKind, c *net.TCPConn) error {
	switch k {
	case soakEcho, soakLong:
		_, err := io.Copy(c, c)
		if err == nil {
			err = c.CloseWrite()
		}
		return err

	case soakServerFirst, soakBigDown, soakBigUp:
		return serveServerFirst(c)

	case soakClientAbort:
		h, err := readHeader(c)
		if err != nil {
			return nil // the reset overtook the header
		}
		_, err = readPattern(c, upSeed(uint64(h.index)), h.a)
		if errors.Is(err, errWrongBytes) || errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		return nil

	case soakBackendReset:
		h, err := readHeader(c)
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		if n, err := readPattern(io.LimitReader(c, h.a), upSeed(uint64(h.index)), chaosEndless); err != nil || n != h.a {
			return fmt.Errorf("conn %d: read %d bytes before the reset: got %d, %w", h.index, h.a, n, err)
		}
		_ = c.SetLinger(0)
		return nil

	case soakStall:
		// Never answer; the client's reset (or FIN) must reach us.
		_, err := io.Copy(io.Discard, c)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("stalled: the client's end never arrived: %w", err)
		}
		return nil

	case soakHalfOpen:
		h, err := readHeader(c)
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		// Write until the client's reset makes a write fail; it must.
		if _, err := io.Copy(c, payload(downSeed(uint64(h.index)), chaosEndless)); err == nil {
			return fmt.Errorf("conn %d: wrote %d bytes to a client that went away", h.index, chaosEndless)
		} else if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("conn %d: the client's reset never arrived: %w", h.index, err)
		}
		return nil

	case soakIdle:
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			return fmt.Errorf("got %d bytes, %v; want EOF at once", n, err)
		}
	}
	return nil
}

// --- nodes fed by xDS and the Istio CA ---
