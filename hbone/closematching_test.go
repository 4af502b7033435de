package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
)

// CloseMatching closes exactly the connections whose handshake the predicate rejects, on
// either side, and the streams on them end with the predicate's error; a stream on another
// connection keeps carrying bytes.
func TestCloseMatching(t *testing.T) {
	const otherID = "spiffe://cluster.local/ns/default/sa/other"
	e := newEnv(t, ServerConfig{}, echo)
	otherTLS := testCA().ClientConfig(otherID)
	e.pool.tlsConfig = func(ctx context.Context, k Key) (*tls.Config, error) {
		if k.Src == identity.MustParse(otherID) {
			return otherTLS, nil
		}
		return cliTLS, nil
	}
	other := NewKey(identity.MustParse(otherID), ids(serverID), e.addr, z0)
	kept := e.dial(t, "kept:80")
	defer kept.Close()
	doomed, err := e.pool.Dial(context.Background(), other, "doomed:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer doomed.Close()
	roundTrip(t, kept, "before")
	roundTrip(t, doomed, "before")

	revoked := errors.New("peer revoked")
	byClient := func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) > 0 && len(cs.PeerCertificates[0].URIs) > 0 && cs.PeerCertificates[0].URIs[0].String() == otherID {
			return revoked
		}
		return nil
	}
	if n := e.srv.CloseMatching(byClient); n != 1 {
		t.Fatalf("server closed %d connections, want 1 (the other identity's)", n)
	}
	doomed.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(doomed); !errors.Is(err, ErrConnClosed) {
		t.Fatalf("stream on the closed connection read %v, want ErrConnClosed", err)
	}
	roundTrip(t, kept, "after the server closed the other")

	if n := e.pool.CloseMatching(func(tls.ConnectionState) error { return nil }); n != 0 {
		t.Fatalf("a predicate matching nothing closed %d connections", n)
	}
	roundTrip(t, kept, "after a predicate matching nothing")
	if n := e.pool.CloseMatching(func(tls.ConnectionState) error { return revoked }); n < 1 {
		t.Fatalf("pool closed %d connections, want the kept one", n)
	}
	kept.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := kept.Read(make([]byte, 1)); !errors.Is(err, revoked) {
		t.Fatalf("stream on the closed pooled connection read %v, want the predicate's error", err)
	}
}

func roundTrip(t *testing.T, s *Stream, msg string) {
	t.Helper()
	s.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := s.Write([]byte(msg)); err != nil {
		t.Fatalf("write %q: %v", msg, err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(s, buf); err != nil || string(buf) != msg {
		t.Fatalf("echo of %q: %q, %v", msg, buf, err)
	}
}
