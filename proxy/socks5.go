package proxy

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/xds/state"
)

// SOCKS5 (RFC 1928) constants: no-auth CONNECT only.
const (
	socksVersion      = 5
	socksNoAuth       = 0
	socksNoAcceptable = 0xFF
	socksConnect      = 1
	atypIPv4          = 1
	atypDomain        = 3
	atypIPv6          = 4

	repSucceeded          = 0
	repGeneralFailure     = 1
	repNotAllowed         = 2
	repHostUnreachable    = 4
	repConnectionRefused  = 5
	repCommandUnsupported = 7
	repAddressUnsupported = 8
)

// socksHandshakeTimeout bounds how long a client may take to send its request.
const socksHandshakeTimeout = 10 * time.Second

// serveSocks5 handles one SOCKS5 client: a no-auth CONNECT to an IPv4, IPv6 or domain
// address, then the same outbound flow as captured traffic. Domain names resolve through
// the workload cache (service hostnames) first, then the system resolver. The reply waits
// until the tunnel to the destination is up, so a refusal or a policy denial reaches the
// client as its RFC 1928 code rather than as a closed connection after "succeeded".
func (p *Proxy) serveSocks5(ctx context.Context, c *net.TCPConn) {
	src, client, dst, ok := p.socks5Handshake(ctx, c)
	if !ok {
		closeRefused(c)
		return
	}
	p.outbound(ctx, c, src, client, dst, func(err error) { writeSocksReply(c, socksReplyCode(err)) })
}

// socks5Handshake reads the client's greeting and CONNECT request and resolves the
// destination. On failure it has answered the client, and ok is false.
func (p *Proxy) socks5Handshake(ctx context.Context, c *net.TCPConn) (src *state.Workload, client, dst netip.AddrPort, ok bool) {
	_ = c.SetDeadline(time.Now().Add(socksHandshakeTimeout))
	client = addrPortOf(c.RemoteAddr())
	src, err := p.sourceWorkload(ctx, client.Addr())
	if err != nil {
		p.log.Warn("proxy: socks5: unknown source workload", "src", client, "err", err)
		_ = readSocksRequestAndReply(c, repNotAllowed)
		return nil, client, dst, false
	}
	host, port, code, err := readSocksRequest(c)
	if err != nil {
		if code != 0 {
			writeSocksReply(c, code)
		}
		p.log.Debug("proxy: socks5 request", "src", client, "err", err)
		return nil, client, dst, false
	}
	dst, err = p.resolveHost(ctx, src, host, port)
	if err != nil {
		writeSocksReply(c, repHostUnreachable)
		p.log.Debug("proxy: socks5 resolve", "host", host, "err", err)
		return nil, client, dst, false
	}
	_ = c.SetDeadline(time.Time{})
	return src, client, dst, true
}

// closeRefused closes a SOCKS5 client after a failure reply, from the handshake or from
// the tunnel behind it. Closing a socket with unread input makes the kernel answer with a
// reset, which can cost the client the reply it has not read yet; so the proxy
// half-closes, discards what the client still sends (for a second at most), then closes.
func closeRefused(c *net.TCPConn) {
	_ = c.CloseWrite()
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
	c.Close()
}

// socksReplyCode is the reply to a CONNECT whose upstream connected (nil) or failed.
func socksReplyCode(err error) byte {
	if err == nil {
		return repSucceeded
	}
	return socksCode(err)
}

// resolveHost turns a SOCKS5 destination into an address: an IP as is; a mesh service
// hostname to its VIP on this network; anything else through the system resolver.
func (p *Proxy) resolveHost(ctx context.Context, src *state.Workload, host string, port uint16) (netip.AddrPort, error) {
	if ip, err := netip.ParseAddr(host); err == nil {
		return netip.AddrPortFrom(ip.Unmap(), port), nil
	}
	name := strings.TrimSuffix(host, ".")
	if svc := p.store.ServiceByHostname(name, src.Namespace); svc != nil {
		for _, a := range svc.Addresses {
			if a.Network == p.cfg.Local.Network && a.Address.IsValid() {
				return netip.AddrPortFrom(a.Address, port), nil
			}
		}
	}
	ips, err := net.DefaultResolver.LookupNetIP(ctx, "ip", name)
	if err != nil {
		return netip.AddrPort{}, err
	}
	if len(ips) == 0 {
		return netip.AddrPort{}, fmt.Errorf("proxy: socks5: %s has no addresses", name)
	}
	return netip.AddrPortFrom(ips[0].Unmap(), port), nil
}

// socksCode maps an upstream failure to a SOCKS5 reply code.
func socksCode(err error) byte {
	var se *hbone.StatusError
	switch {
	case errors.Is(err, errSelfCall):
		return repNotAllowed
	case errors.As(err, &se) && se.Code == 401:
		return repNotAllowed
	case errors.As(err, &se):
		return repConnectionRefused
	case errors.Is(err, state.ErrNoHealthyEndpoint):
		return repHostUnreachable
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return repConnectionRefused
	}
	return repGeneralFailure
}

// readSocksRequest reads the greeting and the CONNECT request. On a protocol error it
// returns the reply code to send (0 when the client is gone). A read never runs past the
// request, since a client may send its first data right behind it; within that, each
// message takes as few reads as its layout allows (one for the usual greeting, two for a
// request to an IP, three for one to a name): each read is a system call on the way to
// the client's first byte.
func readSocksRequest(c net.Conn) (host string, port uint16, code byte, err error) {
	// Greeting: version, method count, methods. The shortest is two bytes (no methods).
	var g [2 + 255]byte
	n, err := io.ReadAtLeast(c, g[:3], 2)
	if err != nil {
		return "", 0, 0, err
	}
	if g[0] != socksVersion {
		return "", 0, 0, fmt.Errorf("proxy: socks5: version %d", g[0])
	}
	methods := g[2 : 2+int(g[1])]
	if len(methods) > 0 { // else the third byte read, if any, was not the greeting's
		if _, err := io.ReadFull(c, g[n:2+len(methods)]); err != nil {
			return "", 0, 0, err
		}
	}
	if !slices.Contains(methods, socksNoAuth) {
		c.Write([]byte{socksVersion, socksNoAcceptable})
		return "", 0, 0, errors.New("proxy: socks5: client offers no no-auth method")
	}
	if _, err := c.Write([]byte{socksVersion, socksNoAuth}); err != nil {
		return "", 0, 0, err
	}

	// Request: version, command, reserved, address type, address, port. The address type
	// says how long the address is, or that its first byte is a name's length.
	var r [5 + 255 + 2]byte
	if _, err := io.ReadFull(c, r[:4]); err != nil {
		return "", 0, 0, err
	}
	if r[0] != socksVersion {
		return "", 0, repGeneralFailure, fmt.Errorf("proxy: socks5: request version %d", r[0])
	}
	if r[1] != socksConnect {
		return "", 0, repCommandUnsupported, fmt.Errorf("proxy: socks5: command %d not supported (CONNECT only)", r[1])
	}
	var rest []byte // address and port
	switch r[3] {
	case atypIPv4:
		rest = r[4 : 4+4+2]
	case atypIPv6:
		rest = r[4 : 4+16+2]
	case atypDomain:
		if _, err := io.ReadFull(c, r[4:5]); err != nil {
			return "", 0, 0, err
		}
		rest = r[5 : 5+int(r[4])+2]
	default:
		return "", 0, repAddressUnsupported, fmt.Errorf("proxy: socks5: address type %d", r[3])
	}
	if _, err := io.ReadFull(c, rest); err != nil {
		return "", 0, 0, err
	}
	addr, pb := rest[:len(rest)-2], rest[len(rest)-2:]
	if r[3] == atypDomain {
		host = string(addr)
	} else {
		ip, _ := netip.AddrFromSlice(addr) // 4 or 16 bytes, as the address type said
		host = ip.String()
	}
	return host, binary.BigEndian.Uint16(pb), 0, nil
}

// readSocksRequestAndReply consumes a request only to refuse it with code.
func readSocksRequestAndReply(c net.Conn, code byte) error {
	_, _, _, err := readSocksRequest(c)
	if err == nil {
		writeSocksReply(c, code)
	}
	return err
}

// writeSocksReply answers with code and an unspecified bound address.
func writeSocksReply(c net.Conn, code byte) {
	_, _ = c.Write([]byte{socksVersion, code, 0, atypIPv4, 0, 0, 0, 0, 0, 0})
}
