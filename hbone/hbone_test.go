package hbone

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net/http"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

func TestEchoHeadersAndIdentity(t *testing.T) {
	leaktest.Check(t)
	var gotReq *Request
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		gotReq = r
		s, err := r.Accept(http.Header{"Baggage": {"k8s.namespace.name=server"}})
		if err != nil {
			return
		}
		defer s.Close()
		io.Copy(s, s)
		s.CloseWrite()
	})
	hdr := http.Header{"Baggage": {"k8s.cluster.name=c1"}, "Forwarded": {`for="10.0.0.1:1234"`}, "Traceparent": {"00-0123456789abcdef0123456789abcdef-0123456789abcdef-00"}}
	s, err := e.pool.Dial(context.Background(), e.key, "10.0.0.5:8080", hdr)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if got := s.Header().Get("Baggage"); got != "k8s.namespace.name=server" {
		t.Errorf("response baggage = %q", got)
	}
	msg := make([]byte, 300<<10)
	rand.Read(msg)
	go func() { s.Write(msg); s.CloseWrite() }()
	got, err := io.ReadAll(s)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, msg) {
		t.Fatalf("echo mismatch: got %d bytes, want %d", len(got), len(msg))
	}
	if gotReq.Authority != "10.0.0.5:8080" || gotReq.Peer.String() != clientID {
		t.Errorf("request authority %q peer %q", gotReq.Authority, gotReq.Peer)
	}
	for k, v := range hdr {
		if gotReq.Header.Get(k) != v[0] {
			t.Errorf("request header %s = %q, want %q", k, gotReq.Header.Get(k), v[0])
		}
	}
}

func TestStatusCodes(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		switch r.Authority {
		case "1.1.1.1:401":
			r.Reject(401)
		case "1.1.1.1:503":
			// return without answering: the server says 503
		default:
			echo(r)
		}
	})
	for _, tc := range []struct {
		auth string
		code int
	}{{"1.1.1.1:401", 401}, {"1.1.1.1:503", 503}, {"bad authority", 400}, {"[::1]:0", 400}, {"1.1.1.1", 400}} {
		_, err := e.pool.Dial(context.Background(), e.key, tc.auth, nil)
		var se *StatusError
		if !errors.As(err, &se) || se.Code != tc.code {
			t.Errorf("Dial(%q) = %v, want status %d", tc.auth, err, tc.code)
		}
	}
	// The connection still serves good streams after the rejections.
	s := e.dial(t, "svc.ns.svc.cluster.local:80")
	s.Write([]byte("ping"))
	s.CloseWrite()
	b, err := io.ReadAll(s)
	if string(b) != "ping" || err != nil {
		t.Errorf("after rejects: %q %v", b, err)
	}
	s.Close()
	if n := e.serverConns(); n != 1 {
		t.Errorf("server saw %d connections, want 1", n)
	}
}
