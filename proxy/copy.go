package proxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"
)

// halfCloser is a connection whose write side can be shut on its own: *net.TCPConn (FIN)
// and *hbone.Stream (END_STREAM).
type halfCloser interface {
	net.Conn
	CloseWrite() error
}

// copyBoth moves bytes both ways until both directions have ended, propagating each
// half-close (EOF on one side becomes FIN/END_STREAM on the other while the opposite
// direction keeps flowing). It returns the bytes copied client→server (received) and
// server→client (sent). Resets and EOFs are clean ends, not errors; any other error aborts
// both directions. It closes neither connection; the caller does.
//
// Plain TCP legs stay *net.TCPConn so io.Copy splices them; hbone.Stream implements
// ReaderFrom/WriterTo so the HTTP/2 leg takes its own fast path.
func copyBoth(client, server halfCloser) (received, sent int64, err error) {
	var wg sync.WaitGroup
	var upErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		received, upErr = copyHalf(server, client)
		if upErr != nil {
			abort(client, server)
		}
	}()
	var downErr error
	sent, downErr = copyHalf(client, server)
	if downErr != nil {
		abort(client, server)
	}
	wg.Wait()
	return received, sent, errors.Join(upErr, downErr)
}

// copyHalf copies src to dst, then half-closes dst.
func copyHalf(dst, src halfCloser) (int64, error) {
	n, err := io.Copy(dst, src)
	if err != nil && !cleanEnd(err) {
		return n, err
	}
	if err := dst.CloseWrite(); err != nil && !cleanEnd(err) {
		return n, err
	}
	return n, nil
}

// abort unblocks the other direction after a failure.
func abort(a, b net.Conn) {
	a.Close()
	b.Close()
}

// cleanEnd reports errors that mean "the peer went away", which a proxy treats as the end
// of the stream rather than a failure.
func cleanEnd(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, io.ErrUnexpectedEOF)
}
