package bench

import (
	"context"
	"fmt"
	"net"
	"time"
)

// Target says where a scenario's connections go: straight to Addr, or through a SOCKS5 proxy
// that is asked to connect to Addr. Any forwarding address (a tunnel's front, a captured
// port) is a direct Target whose Addr is that front.
type Target struct {
	Addr        string        // host:port of the backend as the client names it; host may be a domain name
	SOCKS5      string        // host:port of a SOCKS5 proxy; empty dials Addr directly
	DialTimeout time.Duration // per connection, including the SOCKS5 exchange; zero: 5s
	// DialContext opens the TCP connection (to Addr, or to the SOCKS5 proxy) where the
	// client is not this process's own network: NetnsDialer.DialContext dials from inside a
	// network namespace. nil: a plain net.Dialer.
	DialContext func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (t Target) String() string {
	if t.SOCKS5 != "" {
		return "socks5://" + t.SOCKS5 + " -> " + t.Addr
	}
	return t.Addr
}

// Dial opens one connection to the target, through the proxy if there is one.
func (t Target) Dial(ctx context.Context) (net.Conn, error) {
	timeout := t.DialTimeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	dial := t.DialContext
	if dial == nil {
		var d net.Dialer
		dial = d.DialContext
	}
	if t.SOCKS5 == "" {
		c, err := dial(ctx, "tcp", t.Addr)
		if err != nil {
			return nil, fmt.Errorf("bench: dial: %w", err)
		}
		return c, nil
	}
	c, err := dial(ctx, "tcp", t.SOCKS5)
	if err != nil {
		return nil, fmt.Errorf("bench: dial socks5 proxy: %w", err)
	}
	if err := socks5Connect(ctx, c, t.Addr); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}
