package dns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// reply is the response to req from client over proto ("udp" or "tcp"), sized for it.
func (s *Server) reply(req *dns.Msg, client netip.Addr, proto string) *dns.Msg {
	ctx := s.ctx
	if proto == "tcp" {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.tcpTimeout)
		defer cancel()
	}
	resp := s.respond(ctx, req, client, proto)
	if proto == "udp" {
		resp.Truncate(udpSize(req)) // compresses when that is needed to fit
	} else {
		resp.Compress = true // a forwarded answer may only fit 64 KiB compressed
	}
	return resp
}

// udpSize is the largest UDP response the client accepts: its EDNS payload size, at least 512.
func udpSize(req *dns.Msg) int {
	if opt := req.IsEdns0(); opt != nil && opt.UDPSize() > dns.MinMsgSize {
		return int(opt.UDPSize())
	}
	return dns.MinMsgSize
}

// queryType is the request_query_type label: the lowercase type name.
func queryType(t uint16) string {
	switch t {
	case dns.TypeA:
		return "a"
	case dns.TypeAAAA:
		return "aaaa"
	}
	return strings.ToLower(dns.Type(t).String())
}

// respond builds the response to one request; it never returns nil.
func (s *Server) respond(ctx context.Context, req *dns.Msg, client netip.Addr, proto string) *dns.Msg {
	if len(req.Question) != 1 {
		resp := new(dns.Msg)
		resp.SetRcodeFormatError(req)
		return resp
	}
	if req.Response || req.Opcode != dns.OpcodeQuery {
		// Not a query (the server's accept check drops most of these before us).
		return s.failure(req, dns.RcodeNotImplemented)
	}
	q := req.Question[0]
	src := s.awaitSource(ctx, client)
	labels := [4]string{queryType(q.Qtype), proto, metrics.Unknown, metrics.Unknown}
	if src != nil {
		if src.CanonicalName != "" {
			labels[2] = src.CanonicalName
		}
		if src.CanonicalRevision != "" {
			labels[3] = src.CanonicalRevision
		}
	}
	if s.m != nil {
		s.m.DNSRequests.WithLabelValues(labels[:]...).Inc()
	}
	if src == nil {
		s.logQuery(ctx, src, q, "unknown source", 0)
		return s.failure(req, dns.RcodeServerFailure)
	}
	if (q.Qtype == dns.TypeA || q.Qtype == dns.TypeAAAA) && q.Qclass == dns.ClassINET {
		if m, ok := s.find(src, normalize(q.Name)); ok {
			return s.answer(ctx, req, src, m)
		}
	}
	resp, err := s.forward(ctx, req, labels[:])
	if err != nil {
		s.logQuery(ctx, src, q, "forwarding failed ("+err.Error()+")", 0)
		return s.failure(req, dns.RcodeServerFailure)
	}
	s.logQuery(ctx, src, q, "forwarded", len(resp.Answer))
	return resp
}

// failure is an error response with the request's EDNS echoed.
func (s *Server) failure(req *dns.Msg, rcode int) *dns.Msg {
	resp := new(dns.Msg)
	resp.SetRcode(req, rcode)
	resp.RecursionAvailable = true
	echoEDNS(req, resp)
	return resp
}

// echoEDNS gives resp an OPT record when req had one, with the client's payload size
// (at least 512) and DO bit.
func echoEDNS(req, resp *dns.Msg) {
	if opt := req.IsEdns0(); opt != nil {
		size := opt.UDPSize()
		if size < dns.MinMsgSize {
			size = dns.MinMsgSize
		}
		resp.SetEdns0(size, opt.Do())
	}
}

// answer is the authoritative response for a matched service: NOERROR with an empty answer
// when the service has no address of the requested family, else (CNAME +) A/AAAA records.
func (s *Server) answer(ctx context.Context, req *dns.Msg, src *state.Workload, m match) *dns.Msg {
	q := req.Question[0]
	resp := new(dns.Msg)
	resp.SetReply(req)
	resp.Authoritative = true
	resp.RecursionAvailable = true
	echoEDNS(req, resp)
	v6 := q.Qtype == dns.TypeAAAA
	if !s.familyAllowed(m.svc, v6) {
		s.logQuery(ctx, src, q, "service does not support this record type", 0)
		return resp
	}
	if s.cfg.OwnFamilies && !hasFamily(src, v6) {
		s.logQuery(ctx, src, q, "client has no address of this family", 0)
		return resp
	}
	addrs := s.addresses(src, m.svc, v6)
	if len(addrs) == 0 {
		s.logQuery(ctx, src, q, "no records", 0)
		return resp
	}
	name := q.Name
	resp.Answer = make([]dns.RR, 0, len(addrs)+1)
	if m.alias.stripped != "" && !m.wildcard {
		// Found by stripping a search domain: point the expanded name at the real one.
		target := dns.Fqdn(m.alias.stripped)
		resp.Answer = append(resp.Answer, &dns.CNAME{
			Hdr:    dns.RR_Header{Name: name, Rrtype: dns.TypeCNAME, Class: dns.ClassINET, Ttl: TTL},
			Target: target,
		})
		name = target
	}
	for _, a := range addrs {
		if v6 {
			resp.Answer = append(resp.Answer, &dns.AAAA{
				Hdr:  dns.RR_Header{Name: name, Rrtype: dns.TypeAAAA, Class: dns.ClassINET, Ttl: TTL},
				AAAA: a.AsSlice(),
			})
		} else {
			resp.Answer = append(resp.Answer, &dns.A{
				Hdr: dns.RR_Header{Name: name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: TTL},
				A:   a.AsSlice(),
			})
		}
	}
	s.logQuery(ctx, src, q, "success", len(addrs))
	return resp
}

// logQuery writes the per-query debug record (the Rust ztunnel's fields).
func (s *Server) logQuery(ctx context.Context, src *state.Workload, q dns.Question, result string, endpoints int) {
	if !s.log.Enabled(ctx, slog.LevelDebug) {
		return
	}
	wl, ns := metrics.Unknown, metrics.Unknown
	if src != nil {
		wl, ns = src.Name, src.Namespace
	}
	s.log.LogAttrs(ctx, slog.LevelDebug, "dns query",
		slog.String("src.workload", wl), slog.String("src.namespace", ns),
		slog.String("query", dns.Type(q.Qtype).String()), slog.String("domain", q.Name),
		slog.String("result", result), slog.Int("endpoints", endpoints))
}

// forward sends req to the upstreams in order until one answers: over UDP, and again over
// TCP when the UDP answer is truncated. It counts the upstream metrics.
func (s *Server) forward(ctx context.Context, req *dns.Msg, labels []string) (*dns.Msg, error) {
	if s.m != nil {
		s.m.DNSUpstreamRequests.WithLabelValues(labels...).Inc()
	}
	start := time.Now()
	resp, err := s.forwardAll(ctx, req)
	if s.m != nil {
		s.m.DNSUpstreamDuration.WithLabelValues(labels...).Observe(time.Since(start).Seconds())
		if err != nil {
			s.m.DNSUpstreamFailures.WithLabelValues(labels...).Inc()
		}
	}
	return resp, err
}

func (s *Server) forwardAll(ctx context.Context, req *dns.Msg) (*dns.Msg, error) {
	var errs []error
	for _, up := range s.upstreams {
		resp, err := s.exchange(ctx, "udp", up, req)
		if err == nil && resp.Truncated {
			resp, err = s.exchange(ctx, "tcp", up, req)
		}
		if err == nil {
			resp.Id = req.Id
			return resp, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	if len(errs) == 0 {
		return nil, errors.New("dns: no upstream nameserver")
	}
	return nil, errors.Join(errs...)
}

// exchange sends one query to one upstream under a fresh message ID and waits for the
// matching reply, up to UpstreamTimeout or ctx's end.
func (s *Server) exchange(ctx context.Context, network, upstream string, req *dns.Msg) (*dns.Msg, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.UpstreamTimeout)
	defer cancel()
	c, err := s.dial(ctx, network, upstream)
	if err != nil {
		return nil, fmt.Errorf("dns: upstream %s/%s: %w", network, upstream, err)
	}
	defer c.Close()
	if d, ok := ctx.Deadline(); ok {
		c.SetDeadline(d)
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	out := *req // shallow copy: only the ID changes
	out.Id = dns.Id()
	co := &dns.Conn{Conn: c, UDPSize: dns.MaxMsgSize}
	if err := co.WriteMsg(&out); err != nil {
		return nil, fmt.Errorf("dns: upstream %s/%s: %w", network, upstream, err)
	}
	for {
		resp, err := co.ReadMsg()
		if err != nil {
			if ctx.Err() != nil {
				err = fmt.Errorf("%w (%w)", ctx.Err(), err)
			}
			return nil, fmt.Errorf("dns: upstream %s/%s: %w", network, upstream, err)
		}
		// On UDP a stray or spoofed datagram may arrive first; wait for ours.
		if resp.Id == out.Id && (len(resp.Question) == 0 || len(resp.Question) == 1 &&
			strings.EqualFold(resp.Question[0].Name, req.Question[0].Name) &&
			resp.Question[0].Qtype == req.Question[0].Qtype) {
			return resp, nil
		}
		if network == "tcp" {
			return nil, fmt.Errorf("dns: upstream %s/%s: reply does not match the query", network, upstream)
		}
	}
}

// awaitSource is source, waiting up to Config.WorkloadWait for the store to learn of the
// client: a new pod's first query can race its workload's xDS push.
func (s *Server) awaitSource(ctx context.Context, client netip.Addr) *state.Workload {
	if w := s.source(client); w != nil || s.cfg.WorkloadWait <= 0 {
		return w
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.WorkloadWait)
	defer cancel()
	changes := s.store.Subscribe(ctx)
	for {
		if w := s.source(client); w != nil {
			return w
		}
		select {
		case _, ok := <-changes:
			if !ok {
				return nil
			}
		case <-ctx.Done():
			return nil
		}
	}
}

// source is the client workload of a query from client: Source's answer when set, else
// Local's.
func (s *Server) source(client netip.Addr) *state.Workload {
	if s.cfg.Source != nil {
		return s.cfg.Source(client)
	}
	return s.cfg.Local.Client(s.store, client)
}
