package hbone

import (
	"errors"
	"fmt"
	"net/http"

	"golang.org/x/net/http2"
)

// StatusError is returned by Pool.Dial when the peer answered the CONNECT with a status
// other than 200.
type StatusError struct{ Code int }

func (e *StatusError) Error() string {
	return fmt.Sprintf("hbone: CONNECT answered %d %s", e.Code, http.StatusText(e.Code))
}

// ResetError is a stream reset by the peer: what a read returns once the data queued before
// the reset is read (unless the peer had ended its side: then io.EOF), and what a write
// after the reset wraps, with syscall.EPIPE.
type ResetError struct{ Code http2.ErrCode }

func (e *ResetError) Error() string { return "hbone: stream reset by peer: " + e.Code.String() }

// GoAwayError reports that the peer sent GOAWAY; streams above LastStreamID were never
// processed and may be retried elsewhere.
type GoAwayError struct {
	Code         http2.ErrCode
	LastStreamID uint32
}

func (e *GoAwayError) Error() string {
	return fmt.Sprintf("hbone: connection going away (%s, last stream %d)", e.Code, e.LastStreamID)
}

var (
	// ErrConnClosed is wrapped by errors from streams whose connection ended before the
	// stream did (the data may be truncated, so it is never io.EOF).
	ErrConnClosed = errors.New("hbone: connection closed")
	// errRefused marks a stream the peer never processed (safe to retry).
	errRefused = errors.New("hbone: stream refused")
	errClosed  = errors.New("hbone: pool or server closed")
	// errPingTimeout ends a connection whose peer stopped answering PINGs.
	errPingTimeout = errors.New("hbone: no PING ack in time")
)

// connError is a connection-level protocol error: we send GOAWAY with Code and close.
type connError struct {
	Code   http2.ErrCode
	Reason string
}

func (e connError) Error() string {
	return fmt.Sprintf("hbone: connection error %s: %s", e.Code, e.Reason)
}

// HandshakeError is a server connection's failed TLS handshake, as Serve, ServeConn and
// ServeTLS return it (wrapped, with the peer's address): Err is crypto/tls's error, or
// what the *tls.Config's verification returned. A caller tells a peer that failed its
// handshake from one refused or gone later by it.
type HandshakeError struct{ Err error }

func (e *HandshakeError) Error() string { return e.Err.Error() }
func (e *HandshakeError) Unwrap() error { return e.Err }
