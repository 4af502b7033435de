package hbone

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"testing"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/net/http2"
)

// Our Pool against x/net/http2's own Server.
func TestInteropClientWithXNetServer(t *testing.T) {
	leaktest.Check(t)
	testCA()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	type seen struct{ method, authority, baggage string }
	seenCh := make(chan seen, 10)
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seenCh <- seen{r.Method, r.Host, r.Header.Get("Baggage")}
		if r.Host == "1.2.3.4:401" {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.Header().Set("Baggage", "from=xnet")
		w.WriteHeader(http.StatusOK)
		echoBody(w, r)
	})
	srv := &http2.Server{}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var cwg sync.WaitGroup
		defer cwg.Wait()
		for {
			raw, err := ln.Accept()
			if err != nil {
				return
			}
			cwg.Add(1)
			go func() {
				defer cwg.Done()
				tc := tls.Server(raw, srvTLS)
				if tc.Handshake() != nil {
					return
				}
				srv.ServeConn(tc, &http2.ServeConnOpts{Handler: h})
			}()
		}
	}()
	pool := NewPool(ClientConfig{}, func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer func() {
		pool.Close()
		ln.Close()
		wg.Wait()
	}()
	key := NewKey(identity.MustParse(clientID), nil, netip.MustParseAddrPort(ln.Addr().String()), netip.Addr{})

	s, err := pool.Dial(context.Background(), key, "10.1.2.3:80", http.Header{"Baggage": {"from=gozt"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := <-seenCh; got != (seen{"CONNECT", "10.1.2.3:80", "from=gozt"}) {
		t.Errorf("x/net server saw %+v", got)
	}
	if s.Header().Get("Baggage") != "from=xnet" {
		t.Errorf("response header baggage %q", s.Header().Get("Baggage"))
	}
	msg := make([]byte, 5<<20)
	rand.Read(msg)
	errc := make(chan error, 1)
	go func() {
		_, err := s.Write(msg)
		if err == nil {
			err = s.CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(s)
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo through x/net server: %d bytes, err %v", len(got), err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	s.Close()

	_, err = pool.Dial(context.Background(), key, "1.2.3.4:401", nil)
	var se *StatusError
	if !errors.As(err, &se) || se.Code != 401 {
		t.Errorf("Dial = %v, want 401", err)
	}
	<-seenCh
}

// x/net/http2's Transport against our Server.
func TestInteropXNetTransportWithServer(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		if r.Authority == "9.9.9.9:401" {
			r.Reject(401)
			return
		}
		s, err := r.Accept(http.Header{"Baggage": {"from=gozt-server"}})
		if err != nil {
			return
		}
		defer s.Close()
		s.Write([]byte("hello " + r.Header.Get("Baggage") + "\n"))
		io.Copy(s, s)
		s.CloseWrite()
	})
	tr := &http2.Transport{TLSClientConfig: xnetTLS()}
	defer tr.CloseIdleConnections()
	url := "https://" + e.addr.String()

	// A non-CONNECT request gets 400 ...
	req, _ := http.NewRequest("GET", url+"/", nil)
	res, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != 400 {
		t.Errorf("GET status %d, want 400", res.StatusCode)
	}
	// ... and so does a bad authority, while the connection keeps serving.
	req, _ = http.NewRequest("CONNECT", url, nil)
	req.Host = "10.0.0.1:99999"
	if res, err := tr.RoundTrip(req); err != nil || res.StatusCode != 400 {
		t.Errorf("bad authority: %v %v", res, err)
	} else {
		res.Body.Close()
	}

	pr, pw := io.Pipe()
	req, _ = http.NewRequest("CONNECT", url, pr)
	req.Host = "10.0.0.7:9090"
	req.Header.Set("Baggage", "k8s.cluster.name=c1")
	res, err = tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	if res.StatusCode != 200 || res.Header.Get("Baggage") != "from=gozt-server" {
		t.Fatalf("CONNECT: status %d baggage %q", res.StatusCode, res.Header.Get("Baggage"))
	}
	msg := make([]byte, 3<<20)
	rand.Read(msg)
	go func() {
		pw.Write(msg)
		pw.Close() // END_STREAM from x/net's side: our server half-closes after echoing
	}()
	got, err := io.ReadAll(res.Body)
	res.Body.Close()
	want := append([]byte("hello k8s.cluster.name=c1\n"), msg...)
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("x/net transport read %d bytes (want %d), err %v", len(got), len(want), err)
	}

	req, _ = http.NewRequest("CONNECT", url, nil)
	req.Host = "9.9.9.9:401"
	if res, err := tr.RoundTrip(req); err != nil || res.StatusCode != 401 {
		t.Errorf("401: %v %v", res, err)
	} else {
		res.Body.Close()
	}
	if n := e.serverConns(); n != 1 {
		t.Errorf("x/net transport used %d connections, want 1", n)
	}
}

// echoBody is an x/net/http2 CONNECT handler's tunnel: the request body written back as it
// arrives, after the caller's WriteHeader.
func echoBody(w http.ResponseWriter, r *http.Request) {
	w.(http.Flusher).Flush()
	buf := make([]byte, 64<<10)
	for {
		n, err := r.Body.Read(buf)
		if n > 0 {
			w.Write(buf[:n])
			w.(http.Flusher).Flush()
		}
		if err != nil {
			return
		}
	}
}
