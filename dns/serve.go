package dns

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/sockopt"
)

// maxTCPQueries is how many queries one TCP connection may send, as miekg/dns's server allows.
const maxTCPQueries = 128

// serve has poller watch every socket and answers each query it hands over on a goroutine
// of its own, until ctx ends, Close or Shutdown. Then it stops the watches, ends the TCP
// clients' reads, waits for the queries in flight (Shutdown: until its context ends) and
// closes the sockets. With podpoll an idle DNS proxy thus holds only the goroutine that runs
// Serve, and no read buffer.
func (s *Server) serve(ctx context.Context, poller Poller) error {
	var inflight sync.WaitGroup // Add only from the Poller's callbacks, so before stop returns
	var stops []func()
	var err error
	for i := range s.udp {
		pc, ln := s.udp[i], s.tcp[i]
		stop, werr := poller.WatchPacket(pc, func(b []byte, from netip.AddrPort, to netip.Addr, rerr error) {
			if rerr != nil {
				s.log.Debug("dns: read", "error", rerr)
				return
			}
			q := slices.Clone(b)
			inflight.Add(1)
			go func() {
				defer inflight.Done()
				s.answerUDP(pc, q, from, to)
			}()
		})
		if werr != nil {
			err = werr
			break
		}
		stops = append(stops, stop)
		stop, werr = poller.Watch(ln, func(c net.Conn, aerr error) {
			if aerr != nil {
				s.log.Debug("dns: accept", "error", aerr)
				return
			}
			if !s.addConn(c) {
				c.Close()
				return
			}
			inflight.Add(1)
			go func() {
				defer inflight.Done()
				defer s.removeConn(c)
				s.serveTCP(c)
			}()
		})
		if werr != nil {
			err = werr
			break
		}
		stops = append(stops, stop)
	}
	drain := false
	if err == nil {
		select {
		case <-ctx.Done():
		case <-s.ctx.Done(): // Close
		case <-s.stopping: // Shutdown
			drain = true
		}
	} else {
		err = fmt.Errorf("dns: serve: %w", err)
	}
	for _, stop := range stops {
		stop()
	}
	if !drain {
		s.cancel() // abort forwarding in flight
	}
	s.mu.Lock()
	s.closed = true
	for c := range s.conns {
		c.SetReadDeadline(time.Unix(1, 0)) // an answer being written still goes out
	}
	s.mu.Unlock()
	if drain { // the queries taken are answered until Shutdown's context ends
		answered := make(chan struct{})
		go func() {
			inflight.Wait()
			close(answered)
		}()
		select {
		case <-answered:
		case <-s.drainCtx().Done():
		}
		s.cancel()
	}
	inflight.Wait()
	s.mu.Lock()
	s.closeListenersLocked()
	s.mu.Unlock()
	return err
}

// addConn records a TCP client for serve's stop; false once it is stopping.
func (s *Server) addConn(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	if s.conns == nil {
		s.conns = map[net.Conn]struct{}{}
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *Server) removeConn(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	c.Close()
}

// answerUDP answers one datagram, from the address it was sent to when that is known (a
// socket bound to a wildcard: answerFromDst).
func (s *Server) answerUDP(uc *net.UDPConn, q []byte, from netip.AddrPort, to netip.Addr) {
	out := s.serveMsg(q, from.Addr().Unmap(), "udp")
	if out == nil {
		return
	}
	if _, _, err := uc.WriteMsgUDPAddrPort(out, sockopt.SrcOOB(to), from); err != nil {
		s.log.Debug("dns: write response", "client", from, "error", err)
	}
}

// serveTCP answers a TCP client's queries (each a two-byte length and the message) until
// it closes, sends maxTCPQueries, or sends nothing for tcpTimeout, as miekg/dns's server.
func (s *Server) serveTCP(c net.Conn) {
	client := addrPortOf(c.RemoteAddr()).Addr()
	var msg []byte
	for range maxTCPQueries {
		if !s.waitNext(c) {
			return
		}
		var n [2]byte
		if _, err := io.ReadFull(c, n[:]); err != nil {
			return
		}
		msg = slices.Grow(msg[:0], int(binary.BigEndian.Uint16(n[:])))[:binary.BigEndian.Uint16(n[:])]
		if _, err := io.ReadFull(c, msg); err != nil {
			return
		}
		out := s.serveMsg(msg, client, "tcp")
		if out == nil {
			continue
		}
		frame := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(out)), uint16(len(out)))
		if _, err := c.Write(append(frame, out...)); err != nil {
			s.log.Debug("dns: write response", "client", client, "error", err)
			return
		}
	}
}

// waitNext sets c's deadline for its next query, or reports false once the server is
// stopping. Under s.mu, as the stop's past deadlines are set: a future deadline set
// after them would keep an idle client's connection, and the stop, waiting for it.
func (s *Server) waitNext(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	c.SetReadDeadline(time.Now().Add(s.tcpTimeout))
	return true
}

func addrPortOf(a net.Addr) netip.AddrPort {
	if ta, ok := a.(*net.TCPAddr); ok {
		ap := ta.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return netip.AddrPort{}
}

// headerLen is the size of a DNS message's header.
const headerLen = 12

// serveMsg answers one message as miekg/dns's server does before and after its handler:
// messages that are not queries are dropped or refused by dns.DefaultMsgAcceptFunc, and
// ones that do not parse get FORMERR. It returns the packed answer, or nil for none.
func (s *Server) serveMsg(m []byte, client netip.Addr, proto string) []byte {
	if len(m) < headerLen {
		return nil // too short to answer; any reply could be used to amplify
	}
	req := new(dns.Msg)
	uerr := req.Unpack(m) // sets the header even when the rest does not parse
	dh := dns.Header{
		Id:      binary.BigEndian.Uint16(m[0:]),
		Bits:    binary.BigEndian.Uint16(m[2:]),
		Qdcount: binary.BigEndian.Uint16(m[4:]),
		Ancount: binary.BigEndian.Uint16(m[6:]),
		Nscount: binary.BigEndian.Uint16(m[8:]),
		Arcount: binary.BigEndian.Uint16(m[10:]),
	}
	var resp *dns.Msg
	switch action := dns.DefaultMsgAcceptFunc(dh); {
	case action == dns.MsgIgnore:
		return nil
	case action == dns.MsgAccept && uerr == nil:
		resp = s.reply(req, client, proto)
	default: // refused, or does not parse
		if action != dns.MsgAccept {
			req.Question = nil // miekg/dns refuses before parsing the question
		}
		opcode := req.Opcode
		resp = req.SetRcodeFormatError(req)
		resp.Zero = false
		if action == dns.MsgRejectNotImplemented {
			resp.Opcode, resp.Rcode = opcode, dns.RcodeNotImplemented
		}
		resp.Ns, resp.Answer, resp.Extra = nil, nil, nil
	}
	out, err := resp.Pack()
	if err != nil {
		s.log.Debug("dns: pack response", "client", client, "error", err)
		return nil
	}
	return out
}
