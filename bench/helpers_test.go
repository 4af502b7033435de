package bench

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
)

// startServer starts a Server on loopback and closes it when the test ends.
func startServer(t *testing.T, mode Mode) *Server {
	t.Helper()
	s, err := Listen("127.0.0.1:0", ServerConfig{Mode: mode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// manglingEcho is an echo server that flips one byte of each connection's stream at offset
// at: the fault the generator must catch.
type manglingEcho struct {
	ln net.Listener
	at int64
	wg sync.WaitGroup

	mu    sync.Mutex
	conns []net.Conn
}

func startManglingEcho(t *testing.T, at int64) *manglingEcho {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	m := &manglingEcho{ln: ln, at: at}
	m.wg.Add(1)
	go m.acceptLoop()
	t.Cleanup(m.close)
	return m
}

func (m *manglingEcho) addr() string { return m.ln.Addr().String() }

func (m *manglingEcho) acceptLoop() {
	defer m.wg.Done()
	for {
		c, err := m.ln.Accept()
		if err != nil {
			return
		}
		m.mu.Lock()
		m.conns = append(m.conns, c)
		m.mu.Unlock()
		m.wg.Add(1)
		go m.serve(c)
	}
}

func (m *manglingEcho) serve(c net.Conn) {
	defer m.wg.Done()
	defer c.Close()
	buf := make([]byte, 64<<10)
	var off int64
	for {
		n, err := c.Read(buf)
		if m.at >= off && m.at < off+int64(n) {
			buf[m.at-off] ^= 0x40
		}
		off += int64(n)
		if _, werr := c.Write(buf[:n]); werr != nil {
			return
		}
		if errors.Is(err, io.EOF) {
			closeWrite(c)
			io.Copy(io.Discard, c)
			return
		}
		if err != nil {
			return
		}
	}
}

func (m *manglingEcho) close() {
	m.ln.Close()
	m.mu.Lock()
	for _, c := range m.conns {
		c.Close()
	}
	m.mu.Unlock()
	m.wg.Wait()
}
