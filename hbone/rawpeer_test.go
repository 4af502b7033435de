package hbone

import (
	"bytes"
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// rawPeer is a hand-driven HTTP/2 client on one end of a net.Pipe whose other end our
// Server serves: it writes arbitrary frames and records what the server answers.
type rawPeer struct {
	nc       net.Conn
	wmu      sync.Mutex
	fr       *http2.Framer
	enc      *hpack.Encoder
	hbuf     bytes.Buffer
	ackPings atomic.Bool
	frames   chan frameSummary
	done     chan struct{}
}

type frameSummary struct {
	typ    http2.FrameType
	stream uint32
	code   http2.ErrCode // RST_STREAM / GOAWAY
	status string        // HEADERS
	end    bool
	n      int // DATA length
}

func newRawPeer(nc net.Conn, preface bool) *rawPeer {
	p := &rawPeer{nc: nc, frames: make(chan frameSummary, 4096), done: make(chan struct{})}
	p.fr = http2.NewFramer(nc, nc)
	p.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	p.fr.SetMaxReadFrameSize(1 << 24)
	p.enc = hpack.NewEncoder(&p.hbuf)
	p.ackPings.Store(true)
	go p.readLoop()
	if preface {
		p.write(func() error {
			if _, err := nc.Write([]byte(http2.ClientPreface)); err != nil {
				return err
			}
			return p.fr.WriteSettings()
		})
	}
	return p
}

func (p *rawPeer) write(f func() error) error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	return f()
}

func (p *rawPeer) readLoop() {
	defer close(p.done)
	defer close(p.frames)
	for {
		f, err := p.fr.ReadFrame()
		if err != nil {
			return
		}
		s := frameSummary{typ: f.Header().Type, stream: f.Header().StreamID, end: f.Header().Flags.Has(http2.FlagDataEndStream)}
		switch f := f.(type) {
		case *http2.RSTStreamFrame:
			s.code = f.ErrCode
		case *http2.GoAwayFrame:
			s.code = f.ErrCode
		case *http2.MetaHeadersFrame:
			s.status = f.PseudoValue("status")
		case *http2.DataFrame:
			s.n = len(f.Data())
		case *http2.PingFrame:
			if !f.IsAck() && p.ackPings.Load() {
				data := f.Data
				go p.write(func() error { return p.fr.WritePing(true, data) })
			}
		case *http2.SettingsFrame:
			if !f.IsAck() {
				go p.write(p.fr.WriteSettingsAck)
			}
		}
		select {
		case p.frames <- s:
		default:
		}
	}
}

func (p *rawPeer) headers(id uint32, end bool, fields ...string) error {
	return p.write(func() error {
		p.hbuf.Reset()
		for i := 0; i+1 < len(fields); i += 2 {
			p.enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
		}
		return p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: p.hbuf.Bytes(), EndHeaders: true, EndStream: end})
	})
}

// waitFor returns the first frame from the server that matches, or fails.
func (p *rawPeer) waitFor(t *testing.T, what string, match func(frameSummary) bool) frameSummary {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case f, ok := <-p.frames:
			if !ok {
				t.Fatalf("connection ended before %s", what)
			}
			if match(f) {
				return f
			}
		case <-timeout:
			t.Fatalf("no %s from the server", what)
		}
	}
}

func serveRaw(t *testing.T, cfg ServerConfig, h Handler) (*rawPeer, chan error, func()) {
	a, b := net.Pipe()
	srv := NewServer(cfg, h)
	done := make(chan error, 1)
	go func() { done <- srv.ServeConn(context.Background(), a) }()
	p := newRawPeer(b, true)
	return p, done, func() {
		b.Close()
		<-p.done
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Error("ServeConn did not return after the peer closed")
		}
	}
}

func TestProtocolErrors(t *testing.T) {
	connect := []string{":method", "CONNECT", ":authority", "10.0.0.1:80"}
	goaway := func(code http2.ErrCode) func(frameSummary) bool {
		return func(f frameSummary) bool { return f.typ == http2.FrameGoAway && f.code == code }
	}
	rst := func(id uint32, code http2.ErrCode) func(frameSummary) bool {
		return func(f frameSummary) bool { return f.typ == http2.FrameRSTStream && f.stream == id && f.code == code }
	}
	for _, tc := range []struct {
		name  string
		cfg   ServerConfig
		send  func(p *rawPeer)
		want  func(frameSummary) bool
		alive bool // the connection must survive (a stream error)
	}{
		{"stream window exceeded", ServerConfig{Config: Config{StreamWindow: 16384}}, func(p *rawPeer) {
			p.headers(1, false, connect...)
			p.write(func() error { return p.fr.WriteData(1, false, make([]byte, 20000)) })
		}, rst(1, http2.ErrCodeFlowControl), true},
		{"connection window exceeded", ServerConfig{Config: Config{ConnWindow: 65535}}, func(p *rawPeer) {
			p.headers(1, false, connect...)
			p.headers(3, false, connect...)
			p.write(func() error { return p.fr.WriteData(1, false, make([]byte, 40000)) })
			p.write(func() error { return p.fr.WriteData(3, false, make([]byte, 40000)) })
		}, goaway(http2.ErrCodeFlowControl), false},
		{"DATA on idle stream", ServerConfig{}, func(p *rawPeer) {
			p.write(func() error { return p.fr.WriteData(99, false, []byte("x")) })
		}, goaway(http2.ErrCodeProtocol), false},
		{"connection window overflow", ServerConfig{}, func(p *rawPeer) {
			p.write(func() error { return p.fr.WriteWindowUpdate(0, 1<<31-1) })
		}, goaway(http2.ErrCodeFlowControl), false},
		{"stream window overflow", ServerConfig{}, func(p *rawPeer) {
			p.headers(1, false, connect...)
			p.write(func() error { return p.fr.WriteWindowUpdate(1, 1<<31-1) })
		}, rst(1, http2.ErrCodeFlowControl), true},
		{"even stream id", ServerConfig{}, func(p *rawPeer) { p.headers(2, false, connect...) }, goaway(http2.ErrCodeProtocol), false},
		{"GET gets 400", ServerConfig{}, func(p *rawPeer) {
			p.headers(1, true, ":method", "GET", ":scheme", "https", ":path", "/", ":authority", "x:1")
		}, func(f frameSummary) bool {
			return f.typ == http2.FrameHeaders && f.stream == 1 && f.status == "400" && f.end
		}, true},
		{"uppercase header name", ServerConfig{}, func(p *rawPeer) {
			p.headers(1, false, append(connect, "Bad", "x")...)
		}, rst(1, http2.ErrCodeProtocol), true},
		{"PUSH_PROMISE from client", ServerConfig{}, func(p *rawPeer) {
			p.write(func() error {
				return p.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, EndHeaders: true})
			})
		}, goaway(http2.ErrCodeProtocol), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leaktest.Check(t)
			p, done, stop := serveRaw(t, tc.cfg, func(r *Request) {
				s, err := r.Accept(nil)
				if err == nil {
					<-s.c.done // hold the stream, never read, until the connection ends
					s.Close()
				}
			})
			defer stop()
			tc.send(p)
			p.waitFor(t, "the expected error", tc.want)
			if tc.alive {
				p.write(func() error { return p.fr.WritePing(false, [8]byte{1}) })
				p.waitFor(t, "PING ack", func(f frameSummary) bool { return f.typ == http2.FramePing })
			} else {
				select {
				case err := <-done:
					if err == nil || !strings.Contains(err.Error(), "connection error") {
						t.Errorf("ServeConn = %v, want a connection error", err)
					}
					done <- err
				case <-time.After(5 * time.Second):
					t.Error("connection not closed after a connection error")
				}
			}
		})
	}
}

// The server drops a peer that stops answering PINGs: first PING after 10 s, dropped 20 s
// later. Runs in fake time.
func TestPingTimeout(t *testing.T) {
	leaktest.Check(t)
	synctest.Test(t, func(t *testing.T) {
		a, b := net.Pipe()
		srv := NewServer(ServerConfig{}, echo)
		done := make(chan error, 1)
		go func() { done <- srv.ServeConn(context.Background(), a) }()
		p := newRawPeer(b, true)
		start := time.Now()
		time.Sleep(time.Minute) // pings answered: the connection lives
		synctest.Wait()
		select {
		case err := <-done:
			t.Fatalf("ServeConn returned %v while PINGs were answered", err)
		default:
		}
		p.ackPings.Store(false)
		stopped := time.Now()
		err := <-done
		if !strings.Contains(err.Error(), "PING") {
			t.Errorf("ServeConn = %v, want a PING timeout", err)
		}
		if d := time.Since(stopped); d > 30*time.Second || d < 20*time.Second {
			t.Errorf("dropped %v after PINGs stopped being answered, want 20-30s", d)
		}
		_ = start
		b.Close()
		<-p.done
	})
}

// A client may send DATA right after its CONNECT HEADERS, before the answer. When the
// request is rejected that data is dropped, and its connection window must go back to the
// client, or every rejected request that sent early data shrinks the connection's window.
func TestRejectReleasesEarlyData(t *testing.T) {
	leaktest.Check(t)
	const early = 30000
	p, _, stop := serveRaw(t, ServerConfig{Config: Config{ConnWindow: 65535}}, func(r *Request) {
		c := r.s.c
		for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			c.mu.Lock()
			n := r.s.rb.n
			c.mu.Unlock()
			if n == early {
				break
			}
		}
		r.Reject(401)
	})
	defer stop()
	p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	p.write(func() error { return p.fr.WriteData(1, false, make([]byte, early)) })
	p.waitFor(t, "401", func(f frameSummary) bool { return f.typ == http2.FrameHeaders && f.status == "401" })
	p.waitFor(t, "connection WINDOW_UPDATE", func(f frameSummary) bool {
		return f.typ == http2.FrameWindowUpdate && f.stream == 0
	})
}
