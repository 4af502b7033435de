package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"time"
)

// SOCKS5 (RFC 1928) CONNECT without authentication: the only part of the protocol a load
// generator needs. Domain names are passed to the proxy unresolved.
const (
	socksVersion    = 5
	socksNoAuth     = 0
	socksCmdConnect = 1
	socksAtypIPv4   = 1
	socksAtypDomain = 3
	socksAtypIPv6   = 4
)

var socksReplies = [...]string{
	1: "general failure",
	2: "connection not allowed by ruleset",
	3: "network unreachable",
	4: "host unreachable",
	5: "connection refused",
	6: "TTL expired",
	7: "command not supported",
	8: "address type not supported",
}

// socks5Connect asks the proxy on c to connect to target and waits for its answer. The
// context's deadline bounds the exchange.
func socks5Connect(ctx context.Context, c net.Conn, target string) error {
	host, portStr, err := net.SplitHostPort(target)
	if err != nil {
		return fmt.Errorf("bench: socks5 target %q: %w", target, err)
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return fmt.Errorf("bench: socks5 target %q: bad port", target)
	}
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
		defer c.SetDeadline(time.Time{})
	}
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	// The request waits for the greeting's reply, as RFC 1928 describes, even though that
	// costs a round trip: some servers discard bytes that arrive early.
	var resp [4]byte
	if _, err := c.Write([]byte{socksVersion, 1, socksNoAuth}); err != nil {
		return fmt.Errorf("bench: socks5 greeting: %w", err)
	}
	if _, err := io.ReadFull(c, resp[:2]); err != nil {
		return fmt.Errorf("bench: socks5 greeting reply: %w", err)
	}
	if resp[0] != socksVersion || resp[1] != socksNoAuth {
		return fmt.Errorf("bench: socks5 proxy refused no-auth (version %d method %d)", resp[0], resp[1])
	}

	req := []byte{socksVersion, socksCmdConnect, 0}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.Is4() {
			req = append(req, socksAtypIPv4)
		} else {
			req = append(req, socksAtypIPv6)
		}
		req = append(req, ip.AsSlice()...)
	} else {
		if len(host) > 255 {
			return fmt.Errorf("bench: socks5 target %q: name too long", target)
		}
		req = append(req, socksAtypDomain, byte(len(host)))
		req = append(req, host...)
	}
	req = binary.BigEndian.AppendUint16(req, uint16(port))
	if _, err := c.Write(req); err != nil {
		return fmt.Errorf("bench: socks5 request: %w", err)
	}

	if _, err := io.ReadFull(c, resp[:4]); err != nil {
		return fmt.Errorf("bench: socks5 connect reply: %w", err)
	}
	if resp[0] != socksVersion {
		return fmt.Errorf("bench: socks5 connect reply: version %d", resp[0])
	}
	if resp[1] != 0 {
		msg := "unknown error"
		if int(resp[1]) < len(socksReplies) {
			msg = socksReplies[resp[1]]
		}
		return fmt.Errorf("bench: socks5 connect %s: %s (%d)", target, msg, resp[1])
	}
	var skip int
	switch resp[3] {
	case socksAtypIPv4:
		skip = 4
	case socksAtypIPv6:
		skip = 16
	case socksAtypDomain:
		var l [1]byte
		if _, err := io.ReadFull(c, l[:]); err != nil {
			return fmt.Errorf("bench: socks5 connect reply: %w", err)
		}
		skip = int(l[0])
	default:
		return fmt.Errorf("bench: socks5 connect reply: bad address type %d", resp[3])
	}
	var rest [255 + 2]byte
	if _, err := io.ReadFull(c, rest[:skip+2]); err != nil {
		return fmt.Errorf("bench: socks5 connect reply: %w", err)
	}
	return nil
}
