package dns

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/sockopt"
)

// maxTCPQueries is how many queries one TCP connection may send, as miekg/dns's server allows.
const maxTCPQueries = 128

// udpReadSize is how much of a UDP query is read: 4 KiB, RFC 6891's recommended largest
// EDNS payload and hickory's receive buffer (the Rust ztunnel's). A longer query is cut to
// it and answered FORMERR, as miekg/dns's server did with this size, whichever Poller
// read it.
const udpReadSize = 4096

// serve has poller watch every socket and answers each query it hands over on a goroutine
// of its own, until ctx ends, Close or Shutdown. Then it stops the watches, ends the TCP
// clients' reads, waits for the queries in flight (Shutdown: until its context ends) and
// closes the sockets. With the node's epoll poller an idle DNS proxy thus holds only the
// goroutine that runs Serve, and no read buffer. A stopped watch leaves its socket open:
// UDP answers leave by the socket their query came in on.
//
// Shutdown first takes the sockets out of their SO_REUSEPORT groups (leave), so that no
// query reaches a socket that is no longer read: the queries it had taken, those queued on
// its UDP sockets included (readQueued), are answered, and every later one goes to the
// sockets bound beside it.
func (s *Server) serve(ctx context.Context, poller netpoll.Poller) error {
	var inflight sync.WaitGroup // Add only from the Poller's callbacks and readQueued, so before Wait
	var stops []func()
	var err error
	reads := make([]func(b []byte, from netip.AddrPort, to netip.Addr, rerr error), len(s.udp))
	for i := range s.udp {
		pc, ln := s.udp[i], s.tcp[i]
		reads[i] = func(b []byte, from netip.AddrPort, to netip.Addr, rerr error) {
			if rerr != nil {
				s.log.Debug("dns: read", "error", rerr)
				return
			}
			q := slices.Clone(b[:min(len(b), udpReadSize)])
			inflight.Add(1)
			go func() {
				defer inflight.Done()
				s.answerUDP(pc, q, from, to)
			}()
		}
		stop, werr := poller.WatchPacket(pc, reads[i])
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
		case <-s.stopping: // Shutdown; one whose context has ended already stops as Close
			drain = s.drainCtx().Err() == nil
		}
	} else {
		err = fmt.Errorf("dns: serve: %w", err)
	}
	if drain {
		s.leave()
	}
	for _, stop := range stops {
		stop()
	}
	if drain {
		s.readQueued(reads)
	} else {
		s.cancel() // abort forwarding in flight
	}
	s.mu.Lock()
	s.closed, s.draining = true, drain
	for c, answered := range s.conns {
		if !drain {
			c.SetReadDeadline(time.Unix(1, 0)) // an answer being written still goes out
		} else if answered {
			closeRead(c)
		}
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
		case <-s.ctx.Done(): // Close
		}
		s.cancel()
		s.mu.Lock()
		s.draining = false
		for c := range s.conns {
			c.SetReadDeadline(time.Unix(1, 0))
		}
		s.mu.Unlock()
	}
	inflight.Wait()
	s.mu.Lock()
	s.closeListenersLocked()
	s.mu.Unlock()
	return err
}

// leave takes a draining server's sockets out of their SO_REUSEPORT groups at once, so that
// the kernel gives every new query to the sockets bound beside them (a new ztunnel's), none
// to a socket that no longer reads. Each TCP listener closes: the kernel moves the
// connections it had queued to another listener of the group (net.ipv4.tcp_migrate_req,
// which in-pod mode sets), or resets them if there is none. Each UDP socket stops taking
// datagrams but stays open, to read those it has queued and to answer from its address
// (sockopt.StopDelivery). Before Linux 5.4 the kernel may still pick a connected socket of a
// group: its queries are then lost, as they were before this.
func (s *Server) leave() {
	for _, ln := range s.tcp {
		ln.Close()
	}
	if err := sockopt.StopDelivery(s.udp...); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		s.log.Warn("dns: draining UDP socket may still be sent queries it will not read", "error", err)
	}
}

// readQueued hands read each datagram the UDP sockets have queued, once their watches have
// stopped: the queries the kernel gave them before leave, which nothing else reads.
func (s *Server) readQueued(reads []func(b []byte, from netip.AddrPort, to netip.Addr, rerr error)) {
	buf, oob := make([]byte, udpReadSize), make([]byte, sockopt.DstOOBSize)
	for i, uc := range s.udp {
		rc, err := uc.SyscallConn()
		if err != nil {
			continue
		}
		read := func(b []byte, from netip.AddrPort, to netip.Addr) { reads[i](b, from, to, nil) }
		// A failed recvmsg reports an error the socket had pending, once: then read on. The
		// socket takes no new datagram, so its queue, bounded by its receive buffer, ends.
		for range 2 {
			if _, err = sockopt.ReadQueued(rc, buf, oob, maxQueued, read); err == nil {
				break
			}
		}
		if err != nil && !errors.Is(err, errors.ErrUnsupported) {
			s.log.Debug("dns: read queued queries", "error", err)
		}
	}
}

// maxQueued bounds readQueued per socket, should a socket that failed to leave its group
// keep taking queries: more datagrams than a default receive buffer holds.
const maxQueued = 1 << 14

// closeRead ends c's reads once what the client has sent already is read: a draining
// server answers the queries a TCP client has sent and then closes, rather than cut a
// query in the middle or leave it unread.
func closeRead(c net.Conn) {
	if cr, ok := c.(interface{ CloseRead() error }); ok {
		cr.CloseRead()
		return
	}
	c.SetReadDeadline(time.Unix(1, 0))
}

// addConn records a TCP client for serve's stop; false once it is stopping.
func (s *Server) addConn(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	if s.conns == nil {
		s.conns = map[net.Conn]bool{}
	}
	s.conns[c] = false
	return true
}

func (s *Server) removeConn(c net.Conn) {
	s.mu.Lock()
	delete(s.conns, c)
	s.mu.Unlock()
	c.Close()
}

// answered records that c has had a query answered. While draining, a client that has had
// one is served only the queries it has sent already; one that has not is waited for.
func (s *Server) answered(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conns[c] {
		return
	}
	s.conns[c] = true
	if s.draining {
		closeRead(c)
	}
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
		if out != nil {
			frame := binary.BigEndian.AppendUint16(make([]byte, 0, 2+len(out)), uint16(len(out)))
			if _, err := c.Write(append(frame, out...)); err != nil {
				s.log.Debug("dns: write response", "client", client, "error", err)
				return
			}
		}
		s.answered(c)
	}
}

// waitNext sets c's deadline for its next query, or reports false once the server is
// stopping (and not draining). Under s.mu, as the stop's past deadlines are set: a future
// deadline set after them would keep an idle client's connection, and the stop, waiting
// for it.
func (s *Server) waitNext(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed && !s.draining {
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
