package hbone

import (
	"context"
	"io"
	"net"
	"sync/atomic"
	"testing"
)

// TestDialHook: with ClientConfig.Dial set, the pool opens its TCP connections through it, with
// the dialer it would have used, and reuses the connection for the next stream.
func TestDialHook(t *testing.T) {
	var calls atomic.Int32
	cfg := ClientConfig{Dial: func(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
		calls.Add(1)
		if d == nil || network != "tcp" {
			t.Errorf("Dial(%v, %q): want a dialer and tcp", d, network)
		}
		return d.DialContext(ctx, network, address)
	}}
	e := newEnvConfigs(t, ServerConfig{}, cfg, echo)
	for range 2 {
		s := e.dial(t, "10.0.0.1:80")
		if _, err := s.Write([]byte("hi")); err != nil {
			t.Fatal(err)
		}
		s.CloseWrite()
		if b, err := io.ReadAll(s); err != nil || string(b) != "hi" {
			t.Fatalf("echo = %q, %v; want hi", b, err)
		}
		s.Close()
	}
	if got := calls.Load(); got != 1 {
		t.Errorf("Dial called %d times; want 1 (the second stream reuses the connection)", got)
	}
}
