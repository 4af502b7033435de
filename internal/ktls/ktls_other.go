//go:build !linux

package ktls

import (
	"crypto/tls"
	"errors"
	"net"
	"syscall"
	"time"
)

// Kernel TLS is Linux's: elsewhere Enable always falls back with ReasonNotSupported, and
// Conn and Splicer exist only so callers compile.

func enable(*net.TCPConn, *trafficKeys, tls.ConnectionState) (*Conn, error) {
	return nil, &FallbackError{Reason: ReasonNotSupported, Err: errors.ErrUnsupported}
}

func setULP(int) error { return errors.ErrUnsupported }

// Conn is never returned outside Linux.
type Conn struct{ tcp *net.TCPConn }

func (c *Conn) ConnectionState() tls.ConnectionState  { return tls.ConnectionState{} }
func (c *Conn) NetConn() *net.TCPConn                 { return c.tcp }
func (c *Conn) SyscallConn() (syscall.RawConn, error) { return c.tcp.SyscallConn() }
func (c *Conn) Read(b []byte) (int, error)            { return 0, errors.ErrUnsupported }
func (c *Conn) Write(b []byte) (int, error)           { return 0, errors.ErrUnsupported }
func (c *Conn) WriteMore(b []byte) (int, error)       { return 0, errors.ErrUnsupported }
func (c *Conn) CloseWrite() error                     { return errors.ErrUnsupported }
func (c *Conn) Close() error                          { return c.tcp.Close() }
func (c *Conn) Records() (tx, rx uint64, err error)   { return 0, 0, errors.ErrUnsupported }
func (c *Conn) LocalAddr() net.Addr                   { return c.tcp.LocalAddr() }
func (c *Conn) RemoteAddr() net.Addr                  { return c.tcp.RemoteAddr() }
func (c *Conn) SetDeadline(t time.Time) error         { return c.tcp.SetDeadline(t) }
func (c *Conn) SetReadDeadline(t time.Time) error     { return c.tcp.SetReadDeadline(t) }
func (c *Conn) SetWriteDeadline(t time.Time) error    { return c.tcp.SetWriteDeadline(t) }

// KernelRekeys is Linux's: false elsewhere.
func KernelRekeys() bool { return false }

// ErrNotData is Linux's.
var ErrNotData = errors.New("ktls: splice: next record is not application data")

// Splicer is Linux's; NewSplicer fails elsewhere.
type Splicer struct{}

func NewSplicer() (*Splicer, error)                            { return nil, errors.ErrUnsupported }
func (s *Splicer) Buffered() int                               { return 0 }
func (s *Splicer) Fill(src syscall.Conn, max int) (int, error) { return 0, errors.ErrUnsupported }
func (s *Splicer) Drain(dst syscall.Conn, more bool) (int, error) {
	return 0, errors.ErrUnsupported
}
func (s *Splicer) DrainN(dst syscall.Conn, n int, more bool) (int, error) {
	return 0, errors.ErrUnsupported
}
func (s *Splicer) FillFD(fd, max int) (int, error) { return 0, errors.ErrUnsupported }
func (s *Splicer) DrainFD(fd, n int) (int, error)  { return 0, errors.ErrUnsupported }
func (s *Splicer) Read(p []byte) (int, error)      { return 0, errors.ErrUnsupported }
func (s *Splicer) Close() error                    { return nil }
