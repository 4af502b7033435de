//go:build !linux

package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
)

var errUnsupported = fmt.Errorf("netns: network namespaces need Linux: %w", errors.ErrUnsupported)

// ErrClosed is returned by a NetNS used after Close.
var ErrClosed = errors.New("netns: namespace closed")

// NetNS is an open network namespace; there are none outside Linux.
type NetNS struct{ id ID }

// ID identifies a namespace.
type ID struct{ Dev, Ino uint64 }

func (id ID) String() string { return fmt.Sprintf("net:[%d] dev %d", id.Ino, id.Dev) }

// FromFD closes fd and fails: network namespaces need Linux.
func FromFD(fd int) (*NetNS, error) {
	os.NewFile(uintptr(fd), "").Close()
	return nil, errUnsupported
}

// Open fails: network namespaces need Linux.
func Open(path string) (*NetNS, error) { return nil, errUnsupported }

// ID returns the namespace's identity.
func (n *NetNS) ID() ID { return n.id }

// Close does nothing.
func (n *NetNS) Close() error { return nil }

// Do fails: network namespaces need Linux.
func (n *NetNS) Do(fn func() error) error { return errUnsupported }

// Sockets opens sockets in the process's own namespace; marks and port reuse need Linux.
type Sockets struct {
	NS        *NetNS
	Mark      uint32
	ReusePort bool
}

func (s Sockets) check() error {
	if s.NS != nil || s.Mark != 0 || s.ReusePort {
		return errUnsupported
	}
	return nil
}

// Listen opens a stream listener.
func (s Sockets) Listen(ctx context.Context, network, address string) (net.Listener, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	return new(net.ListenConfig).Listen(ctx, network, address)
}

// ListenPacket opens a packet listener.
func (s Sockets) ListenPacket(ctx context.Context, network, address string) (net.PacketConn, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	return new(net.ListenConfig).ListenPacket(ctx, network, address)
}

// Dial connects with d's settings (nil: a zero net.Dialer).
func (s Sockets) Dial(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	if d == nil {
		d = new(net.Dialer)
	}
	return d.DialContext(ctx, network, address)
}

// CheckCapabilities fails: in-pod mode needs Linux.
func CheckCapabilities() error { return errUnsupported }

// NewAnonymous skips t: network namespaces need Linux.
func NewAnonymous(t TB) *NetNS {
	t.Helper()
	t.Skip("netns: network namespaces need Linux")
	return nil
}
