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

func check(int) (ID, error) { return ID{}, errUnsupported }

func openFD(string) (int, error) { return -1, errUnsupported }

func closeFD(fd int) error { return os.NewFile(uintptr(fd), "").Close() }

func (n *NetNS) do(func() error) error { return errUnsupported }

// Marks and port reuse need Linux too: only the zero Sockets opens sockets here.
func (s Sockets) check() error {
	if s.NS != nil || s.Mark != 0 || s.ReusePort {
		return errUnsupported
	}
	return nil
}

func (s Sockets) listen(ctx context.Context, network, address string) (net.Listener, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	return new(net.ListenConfig).Listen(ctx, network, address)
}

func (s Sockets) listenPacket(ctx context.Context, network, address string) (net.PacketConn, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	return new(net.ListenConfig).ListenPacket(ctx, network, address)
}

func (s Sockets) dial(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
	if err := s.check(); err != nil {
		return nil, err
	}
	if d == nil {
		d = new(net.Dialer)
	}
	return d.DialContext(ctx, network, address)
}

func checkCapabilities() error { return errUnsupported }
