package hbone

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// TestOpenSSLKeyUpdate: OpenSSL's s_server is the HBONE server (the test writes its
// HTTP/2 frames to s_server's standard input) and sends KeyUpdates on its `k` (not
// requested) and `K` (update_requested) commands, between DATA frames. The pool's
// connection (user-space TLS) follows both and answers the request with its own
// KeyUpdate: every DATA byte arrives, hashed, and what the pool sends after the `K`
// reaches s_server (its output shows it decrypted).
func TestOpenSSLKeyUpdate(t *testing.T) {
	bin, err := exec.LookPath("openssl")
	if err != nil {
		t.Skip("no openssl binary")
	}
	leaktest.Check(t)
	testCA()
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	writePEM(t, ca.Issue(serverID), certFile, keyFile)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // s_server binds it; nothing else here takes it meanwhile

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "s_server", "-accept", addr, "-tls1_3", "-alpn", "h2",
		"-cert", certFile, "-key", keyFile, "-naccept", "1", "-msg")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Wait()
	defer cancel()
	var outMu sync.Mutex
	var out bytes.Buffer
	accepting := make(chan struct{})
	outDone := make(chan struct{})
	go func() {
		defer close(outDone)
		r := bufio.NewReader(stdout)
		once := sync.Once{}
		for {
			line, err := r.ReadString('\n')
			outMu.Lock()
			out.WriteString(line)
			outMu.Unlock()
			if strings.HasPrefix(line, "ACCEPT") {
				once.Do(func() { close(accepting) })
			}
			if err != nil {
				return
			}
		}
	}()
	defer func() { cancel(); <-outDone }()
	select {
	case <-accepting:
	case <-time.After(20 * time.Second):
		t.Fatal("s_server did not start")
	}
	output := func() string {
		outMu.Lock()
		defer outMu.Unlock()
		return out.String()
	}

	// s_server answers as an HTTP/2 server would: SETTINGS and an ack of the pool's, then,
	// once the pool's CONNECT is through (its authority, "[::]:80", is one HPACK leaves
	// unencoded: Huffman would not be shorter), the 200.
	var frames bytes.Buffer
	fr := http2.NewFramer(&frames, nil)
	fr.WriteSettings()
	fr.WriteSettingsAck()
	if _, err := stdin.Write(frames.Bytes()); err != nil {
		t.Fatal(err)
	}
	// s_server reads its socket when select(2) says so and then one record: records that
	// came in one segment wait in OpenSSL until the next arrives. A PING every 100 ms
	// (never acked: s_server only prints it) is that next segment.
	pool := NewPool(ClientConfig{Config: Config{DisableKernelTLS: true, PingInterval: 100 * time.Millisecond}},
		func(context.Context, Key) (*tls.Config, error) { return cliTLS, nil })
	defer pool.Close()
	k := NewKey(mustID(clientID), ids(serverID), netip.MustParseAddrPort(addr), z0)
	type dialed struct {
		s   *Stream
		err error
	}
	dc := make(chan dialed, 1)
	go func() {
		dctx, dcancel := context.WithTimeout(ctx, 20*time.Second)
		defer dcancel()
		s, err := pool.Dial(dctx, k, "[::]:80", nil)
		dc <- dialed{s, err}
	}()
	deadline := time.Now().Add(20 * time.Second)
	for !strings.Contains(output(), "[::]:80") && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	frames.Reset()
	var hb bytes.Buffer
	hpack.NewEncoder(&hb).WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	if _, err := stdin.Write(frames.Bytes()); err != nil {
		t.Fatal(err)
	}
	d := <-dc
	if d.err != nil {
		t.Fatalf("Dial s_server: %v\n%s", d.err, output())
	}
	s := d.s
	defer s.Close()
	s.SetReadDeadline(time.Now().Add(30 * time.Second))

	sent, got := sha256.New(), sha256.New()
	buf := make([]byte, 64<<10)
	total := 0
	// burst writes n DATA bytes through s_server and reads them from the stream.
	burst := func(seed byte) {
		t.Helper()
		var data bytes.Buffer
		dfr := http2.NewFramer(&data, nil)
		payload := bytes.Repeat([]byte{seed}, 16<<10)
		for range 4 {
			dfr.WriteData(1, false, payload)
			sent.Write(payload)
		}
		if _, err := stdin.Write(data.Bytes()); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(s, buf); err != nil {
			t.Fatalf("reading the DATA s_server sent: %v\n%s", err, output())
		}
		got.Write(buf)
		total += len(buf)
	}
	// keyUpdates counts the KeyUpdate messages s_server's -msg output shows it sent (">>>")
	// and received ("<<<").
	keyUpdates := func() (sent, received int) {
		for _, line := range strings.Split(output(), "\n") {
			if strings.Contains(line, "KeyUpdate") {
				switch {
				case strings.HasPrefix(line, ">>>"):
					sent++
				case strings.HasPrefix(line, "<<<"):
					received++
				}
			}
		}
		return sent, received
	}
	// command has s_server send a KeyUpdate. Its stdin read must hold the command alone:
	// burst returned only once s_server had sent everything before it, and the next burst
	// waits for the KeyUpdate to have gone out.
	command := func(c string, want int) {
		t.Helper()
		if _, err := io.WriteString(stdin, c+"\n"); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			if n, _ := keyUpdates(); n == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("s_server did not send KeyUpdate %d:\n%s", want, output())
			}
			time.Sleep(time.Millisecond)
		}
	}
	burst('a')
	command("k", 1) // KeyUpdate, update_not_requested
	burst('b')
	command("K", 2) // KeyUpdate, update_requested: the pool answers with its own
	burst('c')
	const marker = "gozt-wrote-this-after-the-requested-update"
	if _, err := s.Write([]byte(marker)); err != nil {
		t.Fatal(err)
	}
	burst('d')
	if !bytes.Equal(sent.Sum(nil), got.Sum(nil)) {
		t.Fatalf("the %d bytes read differ from what s_server sent", total)
	}
	deadline = time.Now().Add(20 * time.Second)
	for !strings.Contains(output(), marker) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	o := output()
	if sentKU, gotKU := keyUpdates(); sentKU != 2 || gotKU != 1 {
		t.Errorf("s_server sent %d KeyUpdates and received %d; want 2 (k and K) and 1 (the answer to K):\n%s", sentKU, gotKU, o)
	}
	if !strings.Contains(o, marker) {
		t.Fatalf("s_server never decrypted what the pool wrote after answering the requested update:\n%s", o)
	}
}

// writePEM writes c's chain and key as PEM files.
func writePEM(t *testing.T, c tls.Certificate, certFile, keyFile string) {
	t.Helper()
	var certs bytes.Buffer
	for _, der := range c.Certificate {
		pem.Encode(&certs, &pem.Block{Type: "CERTIFICATE", Bytes: der})
	}
	der, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(certFile, certs.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}
