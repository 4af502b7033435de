package ktls

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/sys/unix"
)

// These tests need kernel TLS: `make test-ktls` runs them in a VM (scripts/ktls-vm.sh).

func needKernelTLS(t *testing.T) {
	t.Helper()
	if !kernelTLS(t) {
		t.Skip("kernel has no TLS (setsockopt TCP_ULP tls fails): run `make test-ktls`, which boots a kernel that has it")
	}
}

func mustEnable(t *testing.T, s side) *Conn {
	t.Helper()
	kc, err := s.h.Enable()
	if err != nil {
		t.Fatalf("Enable: %v", err)
	}
	t.Cleanup(func() { kc.Close() })
	return kc
}

// TestKTLSBothSides: both ends on kernel TLS, 8 MiB each way at once, each half-closing
// its write side while still reading.
func TestKTLSBothSides(t *testing.T) {
	needKernelTLS(t)
	leaktest.Check(t)
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, true)
	kc, ks := mustEnable(t, client), mustEnable(t, server)
	if kc.ConnectionState().PeerCertificates == nil {
		t.Error("the Conn lost the handshake's peer certificates")
	}
	if _, err := client.tc.Write([]byte("x")); err == nil {
		t.Error("the *tls.Conn still writes after the switch")
	}
	exchange(t, kc, ks, 8<<20)
}

// TestKTLSHalfClose: one side sends and half-closes; the other reads to io.EOF, then
// answers on the same connection, which the first still reads.
func TestKTLSHalfClose(t *testing.T) {
	needKernelTLS(t)
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, true)
	kc, ks := mustEnable(t, client), mustEnable(t, server)
	if _, err := kc.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	if err := kc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(ks)
	if err != nil || string(got) != "request" {
		t.Fatalf("server read %q, %v; want \"request\", EOF", got, err)
	}
	if _, err := ks.Write([]byte("response")); err != nil {
		t.Fatalf("write after the peer's half-close: %v", err)
	}
	ks.CloseWrite()
	if got, err := io.ReadAll(kc); err != nil || string(got) != "response" {
		t.Fatalf("client read %q, %v; want \"response\", EOF", got, err)
	}
}

// TestKTLSWireCompat: one side on kernel TLS, the other plain crypto/tls.
func TestKTLSWireCompat(t *testing.T) {
	needKernelTLS(t)
	ccfg, scfg := testConfigs(t)
	t.Run("kernel client", func(t *testing.T) {
		client, server := handshake(t, ccfg, scfg, true, false)
		exchange(t, mustEnable(t, client), server.tc, 4<<20)
	})
	// A Go server sends NewSessionTickets when the client offers resumption (it has a
	// session cache); without client certificates it sends them right behind its
	// Finished, in the flight the client's handshake reads. They must stay in the socket
	// (record-exact reads) for the kernel to count them, and Read must drop them.
	t.Run("kernel client, tickets", func(t *testing.T) {
		c, s := ccfg.Clone(), scfg.Clone()
		c.ClientSessionCache = tls.NewLRUClientSessionCache(1)
		s.ClientAuth = tls.NoClientCert
		client, server := handshake(t, c, s, true, false)
		kc := mustEnable(t, client)
		exchange(t, kc, server.tc, 1<<20)
	})
	t.Run("kernel server", func(t *testing.T) {
		client, server := handshake(t, ccfg, scfg, false, true)
		exchange(t, client.tc, mustEnable(t, server), 4<<20)
	})
}

// TestKTLSKeyUpdate: the kernel side asks the crypto/tls side for a KeyUpdate
// (update_requested, sent as a handshake record through TLS_SET_RECORD_TYPE); crypto/tls
// answers with its own KeyUpdate and switches keys, and the kernel side's Read reports
// ErrKeyUpdate, after the data sent before it.
func TestKTLSKeyUpdate(t *testing.T) {
	needKernelTLS(t)
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, false)
	kc := mustEnable(t, client)
	if _, err := server.tc.Write([]byte("before")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 6)
	if _, err := io.ReadFull(kc, buf); err != nil || string(buf) != "before" {
		t.Fatalf("read %q, %v", buf, err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := server.tc.Read(make([]byte, 1)) // processes the request, sends KeyUpdate, waits
		done <- err
	}()
	if err := kc.writeRecord(recordTypeHandshake, []byte{typeKeyUpdate, 0, 0, 1, 1}); err != nil {
		t.Fatal(err)
	}
	kc.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := kc.Read(buf); !errors.Is(err, ErrKeyUpdate) {
		t.Fatalf("Read after the peer's KeyUpdate: %v; want ErrKeyUpdate", err)
	}
	if _, err := kc.Read(buf); !errors.Is(err, ErrKeyUpdate) {
		t.Fatalf("second Read: %v; want ErrKeyUpdate again (sticky)", err)
	}
	kc.Close()
	<-done
}

// TestKTLSAlert: an alert other than close_notify reads as a *RecordError.
func TestKTLSAlert(t *testing.T) {
	needKernelTLS(t)
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, true)
	kc, ks := mustEnable(t, client), mustEnable(t, server)
	if err := kc.writeRecord(recordTypeAlert, []byte{2, 80}); err != nil { // fatal internal_error
		t.Fatal(err)
	}
	_, err := ks.Read(make([]byte, 10))
	var re *RecordError
	if !errors.As(err, &re) || re.Type != recordTypeAlert || !bytes.Equal(re.Data, []byte{2, 80}) {
		t.Fatalf("Read: %v; want *RecordError for alert 80", err)
	}
}

// TestKTLSSplice moves 4 MiB from a TCP socket into the kernel TLS socket as HTTP/2-style
// frames (a 9-byte header written with MSG_MORE, the payload spliced after it), to a
// plain crypto/tls reader that checks the frames and the hash; then the other way, frames
// from crypto/tls read as header by Read and payload spliced kernel TLS → TCP. The
// splicing thread's read/write counters show the payload never crossed user space.
func TestKTLSSplice(t *testing.T) {
	needKernelTLS(t)
	const size = 4 << 20
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, false)
	kc := mustEnable(t, client)

	t.Run("tcp to ktls", func(t *testing.T) {
		srcW, srcR := tcpPair(t)
		sent := source(srcW, 4, size)
		got := make(chan [32]byte, 1)
		go func() { got <- readFrames(server.tc) }()
		through := onLockedThread(t, func() {
			s, err := NewSplicer()
			if err != nil {
				t.Error(err)
				return
			}
			defer s.Close()
			for {
				n, err := s.Fill(srcR, 64<<10)
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Error(err)
					return
				}
				var hdr [9]byte
				putFrameHeader(&hdr, n)
				if _, err := kc.WriteMore(hdr[:]); err != nil {
					t.Error(err)
					return
				}
				if _, err := s.Drain(kc, false); err != nil {
					t.Error(err)
					return
				}
			}
			var end [9]byte // a zero-length frame ends the stream
			putFrameHeader(&end, 0)
			if _, err := kc.Write(end[:]); err != nil {
				t.Error(err)
			}
		})
		if a, b := <-sent, <-got; a != b {
			t.Fatalf("the crypto/tls reader's hash %x differs from the TCP source's %x", b[:4], a[:4])
		}
		t.Logf("%d bytes spliced into kernel TLS, %d through read/write on the splicing thread", size, through)
		if through > 64<<10 {
			t.Errorf("splicing thread read/wrote %d bytes; want almost none of the %d", through, size)
		}
	})

	t.Run("ktls to tcp", func(t *testing.T) {
		dstW, dstR := tcpPair(t)
		got := sink(dstR)
		sent := make(chan [32]byte, 1)
		go func() { sent <- writeFrames(server.tc, 5, size) }()
		through := onLockedThread(t, func() {
			s, err := NewSplicer()
			if err != nil {
				t.Error(err)
				return
			}
			defer s.Close()
			var hdr [9]byte
			for {
				if _, err := io.ReadFull(kc, hdr[:]); err != nil {
					t.Error(err)
					return
				}
				left := frameLen(&hdr)
				if left == 0 {
					break
				}
				for left > 0 {
					n, err := s.Fill(kc, left)
					if err != nil {
						t.Error(err)
						return
					}
					if _, err := s.Drain(dstW, false); err != nil {
						t.Error(err)
						return
					}
					left -= n
				}
			}
			dstW.CloseWrite()
		})
		if a, b := <-sent, <-got; a != b {
			t.Fatalf("the TCP sink's hash %x differs from the crypto/tls writer's %x", b[:4], a[:4])
		}
		t.Logf("%d bytes spliced out of kernel TLS, %d through read/write on the splicing thread", size, through)
		if through > 64<<10 {
			t.Errorf("splicing thread read/wrote %d bytes; want almost none of the %d", through, size)
		}
	})
}

// onLockedThread runs f on one OS thread and returns the bytes that thread passed through
// read(2)/write(2) meanwhile.
func onLockedThread(t *testing.T, f func()) int64 {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r0, w0 := threadIO(t)
	f()
	r1, w1 := threadIO(t)
	return (r1 - r0) + (w1 - w0)
}

// A frame here is HTTP/2's shape: 24-bit length, type 0 (DATA), flags, stream 1.
func putFrameHeader(h *[9]byte, n int) {
	h[0], h[1], h[2] = byte(n>>16), byte(n>>8), byte(n)
	h[3], h[4] = 0, 0
	binary.BigEndian.PutUint32(h[5:], 1)
}

func frameLen(h *[9]byte) int { return int(h[0])<<16 | int(h[1])<<8 | int(h[2]) }

// readFrames reads frames until a zero-length one and hashes their payloads.
func readFrames(c net.Conn) (sum [32]byte) {
	h := sha256.New()
	var hdr [9]byte
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil || binary.BigEndian.Uint32(hdr[5:]) != 1 {
			return sum
		}
		n := frameLen(&hdr)
		if n == 0 {
			break
		}
		if _, err := io.CopyN(h, c, int64(n)); err != nil {
			return sum
		}
	}
	copy(sum[:], h.Sum(nil))
	return sum
}

// writeFrames writes size bytes of stream seed as frames of up to 100,000 bytes, then a
// zero-length frame, and returns the payload's hash.
func writeFrames(c net.Conn, seed byte, size int) (sum [32]byte) {
	h := sha256.New()
	src := newStream(seed)
	buf := make([]byte, 9+100000)
	for size > 0 {
		n := min(size, 100000)
		var hdr [9]byte
		putFrameHeader(&hdr, n)
		copy(buf, hdr[:])
		src.Read(buf[9 : 9+n])
		h.Write(buf[9 : 9+n])
		if _, err := c.Write(buf[:9+n]); err != nil {
			return sum
		}
		size -= n
	}
	var end [9]byte
	putFrameHeader(&end, 0)
	if _, err := c.Write(end[:]); err != nil {
		return sum
	}
	copy(sum[:], h.Sum(nil))
	return sum
}

// TestKTLSAvailableFirst: Available installs the ULP before the handshake, which then runs
// over a socket that is still plain TCP; Enable adds the keys.
func TestKTLSAvailableFirst(t *testing.T) {
	needKernelTLS(t)
	ccfg, scfg := testConfigs(t)
	ca, sa := tcpPair(t)
	for _, c := range []*net.TCPConn{ca, sa} {
		if err := Available(c); err != nil {
			t.Fatalf("Available: %v", err)
		}
	}
	ctc, ch := Client(ca, ccfg)
	stc, sh := Server(sa, scfg)
	errc := make(chan error, 1)
	go func() { errc <- sh.Handshake(context.Background()) }()
	if err := ch.Handshake(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	exchange(t, mustEnable(t, side{ctc, ch}), mustEnable(t, side{stc, sh}), 1<<20)
}

// TestKTLSRecords: Records reports the kernel's record sequence numbers, the records each
// direction protected under its key: what the caller drains a connection by before a
// key's limit. crypto/tls writes one record per Write of under 16 KiB; the kernel one
// per Write too (no MSG_MORE). (crypto/tls picks the TLS 1.3 suite itself: the one
// negotiated here.)
func TestKTLSRecords(t *testing.T) {
	needKernelTLS(t)
	ccfg, scfg := testConfigs(t)
	client, server := handshake(t, ccfg, scfg, true, false)
	kc := mustEnable(t, client)
	t.Logf("suite %s", tls.CipherSuiteName(kc.ConnectionState().CipherSuite))
	tx, rx, err := kc.Records()
	if err != nil || tx != 0 || rx != 0 {
		t.Fatalf("Records after the switch: %d, %d, %v; want 0, 0, nil", tx, rx, err)
	}
	const in, out = 37, 11
	go func() {
		for range in {
			server.tc.Write([]byte("0123456789"))
		}
	}()
	if _, err := io.ReadFull(kc, make([]byte, in*10)); err != nil {
		t.Fatal(err)
	}
	for range out {
		if _, err := kc.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := io.ReadFull(server.tc, make([]byte, out)); err != nil {
		t.Fatal(err)
	}
	if tx, rx, err = kc.Records(); err != nil || tx != out || rx != in {
		t.Fatalf("Records: tx %d, rx %d, %v; want %d, %d", tx, rx, err, out, in)
	}
}

// TestKTLSKernelRekeys: the probe says what the kernel's release says: key updates from
// Linux 6.14 on (the VM's Debian 12 kernel is 6.1: false). A distribution kernel with the
// series backported would fail this; the VM's does not have it.
func TestKTLSKernelRekeys(t *testing.T) {
	needKernelTLS(t)
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		t.Fatal(err)
	}
	release := unix.ByteSliceToString(u.Release[:])
	var major, minor int
	if _, err := fmt.Sscanf(release, "%d.%d", &major, &minor); err != nil {
		t.Fatalf("release %q: %v", release, err)
	}
	want := major > 6 || major == 6 && minor >= 14
	if got := KernelRekeys(); got != want {
		t.Fatalf("KernelRekeys on %s: %v; want %v", release, got, want)
	}
	t.Logf("kernel %s: key updates %v", release, want)
}
