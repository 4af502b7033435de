package proxy

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"testing"
)

// FuzzReadSocksRequest feeds arbitrary client bytes to the SOCKS5 request reader. It must
// not panic, and when it accepts a request it must have read exactly that request: the
// bytes behind it are the client's data and have to stay in the connection.
func FuzzReadSocksRequest(f *testing.F) {
	f.Add([]byte{5, 1, 0, 5, 1, 0, 1, 10, 0, 0, 1, 0x1f, 0x90, 'h', 'i'})
	f.Add([]byte{5, 2, 2, 0, 5, 1, 0, 3, 4, 'h', 'o', 's', 't', 0, 80})
	f.Add([]byte{5, 1, 0, 5, 1, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 80})
	f.Add([]byte{5, 0, 5, 1, 0, 1})
	f.Add([]byte{5, 1, 0, 5, 1, 0, 3, 0, 0, 80})
	f.Add([]byte{5, 1, 0, 5, 2, 0, 1})
	f.Fuzz(func(t *testing.T, in []byte) {
		client, server := net.Pipe()
		defer server.Close()
		go func() {
			// Sending in two pieces also exercises a message split across reads.
			half := len(in) / 2
			_, _ = client.Write(in[:half])
			_, _ = client.Write(in[half:])
			client.Close()
		}()
		replies := make(chan struct{})
		go func() { // the client's side of the replies; ends when server closes
			defer close(replies)
			_, _ = io.Copy(io.Discard, client)
		}()
		host, port, _, err := readSocksRequest(server)
		rest, _ := io.ReadAll(server)
		server.Close()
		<-replies
		if err != nil {
			return
		}
		// RFC 1928's layout: greeting 2+NMETHODS bytes; request 4 bytes, the address
		// (4, 16, or 1+length for a name) and a 2-byte port.
		req := 2 + int(in[1])
		addr := map[byte]int{1: 4, 4: 16, 3: 1 + int(in[req+4])}[in[req+3]]
		end := req + 4 + addr + 2
		if !bytes.Equal(rest, in[end:]) {
			t.Fatalf("accepted %q:%d and left %d bytes unread; the request ends at byte %d of %d", host, port, len(rest), end, len(in))
		}
		if want := binary.BigEndian.Uint16(in[end-2:]); port != want {
			t.Fatalf("port %d, want %d", port, want)
		}
	})
}
