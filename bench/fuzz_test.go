package bench

import (
	"bytes"
	"context"
	"io"
	"net"
	"testing"
	"time"
)

func FuzzParseStat(f *testing.F) {
	f.Add([]byte("1234 (zbench) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 8 0 100 0 0"))
	f.Add([]byte("7 (a ) b (c)) R 3 0 0 0 0 0 0 0 0 0 1 2 0"))
	f.Add([]byte("no parens at all"))
	f.Fuzz(func(t *testing.T, b []byte) {
		_, cpu, err := parseStat(b)
		if err == nil && cpu < 0 {
			t.Fatalf("negative cpu time %v from %q", cpu, b)
		}
	})
}

func TestParseStatCommandWithParens(t *testing.T) {
	ppid, cpu, err := parseStat([]byte("7 (a ) b (c)) R 3 0 0 0 0 0 0 0 0 0 250 30 0"))
	if err != nil || ppid != 3 || cpu != 2800*time.Millisecond {
		t.Fatalf("parseStat = %d, %v, %v; want 3, 2.8s, nil", ppid, cpu, err)
	}
}

// scriptedConn replays a server's bytes to the SOCKS5 client and swallows what it writes.
type scriptedConn struct {
	net.Conn // nil: only the methods below are used
	r        io.Reader
	written  bytes.Buffer
}

func (c *scriptedConn) Read(b []byte) (int, error)         { return c.r.Read(b) }
func (c *scriptedConn) Write(b []byte) (int, error)        { return c.written.Write(b) }
func (c *scriptedConn) SetDeadline(time.Time) error        { return nil }
func (c *scriptedConn) SetReadDeadline(time.Time) error    { return nil }
func (c *scriptedConn) SetWriteDeadline(t time.Time) error { return nil }

func FuzzSOCKS5Reply(f *testing.F) {
	f.Add([]byte{5, 0, 5, 0, 0, 1, 127, 0, 0, 1, 0x1f, 0x90})
	f.Add([]byte{5, 0, 5, 0, 0, 3, 4, 'h', 'o', 's', 't', 0, 80})
	f.Add([]byte{5, 0, 5, 0, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 80})
	f.Add([]byte{5, 0, 5, 5, 0, 1, 0, 0, 0, 0, 0, 0})
	f.Add([]byte{5, 0xff})
	f.Fuzz(func(t *testing.T, reply []byte) {
		c := &scriptedConn{r: bytes.NewReader(reply)}
		err := socks5Connect(context.Background(), c, "example.com:443")
		// Greeting reply (2 bytes), then the connect reply: version, status, reserved,
		// address type, at least a one-byte name length, and the port.
		if err == nil && (len(reply) < 9 || reply[0] != 5 || reply[1] != 0 || reply[2] != 5 || reply[3] != 0) {
			t.Fatalf("accepted reply %v", reply)
		}
	})
}
