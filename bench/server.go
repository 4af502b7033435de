package bench

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
)

// Mode selects what a Server does with each connection.
type Mode string

const (
	// ModeEcho writes back every byte it reads and half-closes after the client does. A
	// connection that opens with SourceRequest is served as ModeSource instead, so that one
	// server behind a fixed chain of proxies serves every scenario.
	ModeEcho Mode = "echo"
	// ModeSink reads and checks the pattern stream; when the client half-closes it answers
	// with the byte count (8 bytes, big endian) and a status byte (0 intact, 1 corrupt).
	ModeSink Mode = "sink"
	// ModeSource writes the pattern stream until the client goes away.
	ModeSource Mode = "source"
)

// ServerConfig configures a Server. The zero value is an echo server.
type ServerConfig struct {
	Mode Mode // zero: ModeEcho
}

// Server is the far end of every scenario: the backend a proxy forwards to.
type Server struct {
	ln   net.Listener
	mode Mode
	wg   sync.WaitGroup

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
}

// Listen starts a Server on a TCP address.
func Listen(addr string, cfg ServerConfig) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("bench: listen: %w", err)
	}
	return Serve(ln, cfg)
}

// Serve starts a Server on ln, which it then owns.
func Serve(ln net.Listener, cfg ServerConfig) (*Server, error) {
	mode := cfg.Mode
	switch mode {
	case "":
		mode = ModeEcho
	case ModeEcho, ModeSink, ModeSource:
	default:
		ln.Close()
		return nil, fmt.Errorf("bench: unknown server mode %q", mode)
	}
	s := &Server{ln: ln, mode: mode, conns: make(map[net.Conn]struct{})}
	s.wg.Add(1)
	go s.acceptLoop()
	return s, nil
}

// Addr returns the listening address.
func (s *Server) Addr() net.Addr { return s.ln.Addr() }

// Close stops accepting, closes every open connection and waits for their goroutines.
// It is safe to call more than once.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	conns := make([]net.Conn, 0, len(s.conns))
	for c := range s.conns {
		conns = append(conns, c)
	}
	s.mu.Unlock()

	err := s.ln.Close()
	for _, c := range conns {
		c.Close()
	}
	s.wg.Wait()
	return err
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				slog.Error("bench: accept", "err", err)
			}
			return
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[c] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go s.serveConn(c)
	}
}

func (s *Server) serveConn(c net.Conn) {
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
		c.Close()
	}()
	switch s.mode {
	case ModeEcho:
		serveEcho(c)
	case ModeSink:
		serveSink(c)
	case ModeSource:
		serveSource(c)
	}
}

// SourceRequest opens a throughput --direction down connection: it turns an echo server's
// connection into a source (a source server ignores it). No other client's first bytes
// start with it: pattern and request bytes are pseudo-random.
const SourceRequest = "ZBENCH/1 SOURCE\n"

// serveEcho copies the connection to itself through a 16 KiB buffer. It does not splice: a
// splice holds a pipe pair per connection, so 10,000 idle connections would take 30,000
// file descriptors (a pod's limit here is 20,000); the server's cost is never charged to
// the proxies measured. It first reads for as long as the bytes could still be
// SourceRequest.
func serveEcho(c net.Conn) {
	var head [len(SourceRequest)]byte
	n := 0
	var rerr error
	for n < len(head) && rerr == nil && string(head[:n]) == SourceRequest[:n] {
		var k int
		k, rerr = c.Read(head[n:])
		n += k
	}
	if string(head[:n]) == SourceRequest {
		serveSource(c)
		return
	}
	if _, err := c.Write(head[:n]); err != nil {
		return
	}
	if rerr == nil {
		_, rerr = io.CopyBuffer(struct{ io.Writer }{c}, struct{ io.Reader }{c}, make([]byte, 16<<10))
	}
	if rerr == nil || rerr == io.EOF {
		closeWrite(c)
		io.Copy(io.Discard, c) // wait for the client to finish closing
	}
}

func serveSink(c net.Conn) {
	buf := make([]byte, maxChunk)
	var off int64
	status := byte(0)
	for {
		n, err := c.Read(buf)
		if status == 0 && checkPattern(off, buf[:n]) != nil {
			status = 1
		}
		off += int64(n)
		if err == io.EOF {
			break
		}
		if err != nil {
			return
		}
	}
	var reply [9]byte
	binary.BigEndian.PutUint64(reply[:8], uint64(off))
	reply[8] = status
	if _, err := c.Write(reply[:]); err == nil {
		closeWrite(c)
	}
}

func serveSource(c net.Conn) {
	var off int64
	for {
		n, err := c.Write(patternAt(off, maxChunk))
		off += int64(n)
		if err != nil {
			return
		}
	}
}

// closeWrite half-closes c when it can, else closes it.
func closeWrite(c net.Conn) error {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}
