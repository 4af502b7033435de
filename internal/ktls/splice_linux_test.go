package ktls

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"strconv"
	"testing"
)

// threadIO returns /proc/thread-self/io's rchar and wchar: the bytes this thread passed
// to read(2) and write(2) (and their kin). splice(2) moves bytes without either, so a
// thread that only splices leaves them nearly still. The caller locks its OS thread.
func threadIO(t testing.TB) (rchar, wchar int64) {
	t.Helper()
	b, err := os.ReadFile("/proc/thread-self/io")
	if err != nil {
		t.Skipf("no per-thread I/O counters: %v", err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var k string
		var v int64
		if _, err := fmt.Sscanf(sc.Text(), "%s %d", &k, &v); err != nil {
			continue
		}
		switch k {
		case "rchar:":
			rchar = v
		case "wchar:":
			wchar = v
		}
	}
	return rchar, wchar
}

// sink reads c to EOF and returns the SHA-256 of what it read.
func sink(c io.Reader) <-chan [32]byte {
	out := make(chan [32]byte, 1)
	go func() {
		h := sha256.New()
		_, _ = io.Copy(h, c)
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		out <- sum
	}()
	return out
}

// source writes size bytes of stream seed to c, half-closes it, and returns their hash.
func source(c *net.TCPConn, seed byte, size int) <-chan [32]byte {
	out := make(chan [32]byte, 1)
	go func() {
		h := sha256.New()
		_, _ = io.Copy(c, io.TeeReader(io.LimitReader(newStream(seed), int64(size)), h))
		_ = c.CloseWrite()
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		out <- sum
	}()
	return out
}

// TestSplicerTCP moves 4 MiB TCP → pipe → TCP with a Splicer on a thread whose read/write
// counters barely move, then the same through a user-space buffer, which moves them by the
// payload: the counter tells the two apart. Plain TCP, so it runs on any Linux host.
func TestSplicerTCP(t *testing.T) {
	const size = 4 << 20
	for _, viaSplice := range []bool{true, false} {
		t.Run("splice="+strconv.FormatBool(viaSplice), func(t *testing.T) {
			srcW, srcR := tcpPair(t)
			dstW, dstR := tcpPair(t)
			sent := source(srcW, 3, size)
			got := sink(dstR)

			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			r0, w0 := threadIO(t)
			moved := 0
			if viaSplice {
				s, err := NewSplicer()
				if err != nil {
					t.Fatal(err)
				}
				defer s.Close()
				for {
					n, err := s.Fill(srcR, 256<<10)
					if err == io.EOF {
						break
					}
					if err != nil {
						t.Fatal(err)
					}
					if m, err := s.Drain(dstW, false); err != nil || m != n {
						t.Fatalf("Drain = %d, %v; want %d", m, err, n)
					}
					moved += n
				}
			} else {
				buf := make([]byte, 64<<10)
				for {
					n, err := srcR.Read(buf)
					if n > 0 {
						if _, err := dstW.Write(buf[:n]); err != nil {
							t.Fatal(err)
						}
						moved += n
					}
					if err == io.EOF {
						break
					}
					if err != nil {
						t.Fatal(err)
					}
				}
			}
			r1, w1 := threadIO(t)
			_ = dstW.CloseWrite()
			if moved != size {
				t.Fatalf("moved %d bytes; want %d", moved, size)
			}
			if a, b := <-sent, <-got; a != b {
				t.Fatalf("sink's hash %x differs from the source's %x", b[:4], a[:4])
			}
			through := (r1 - r0) + (w1 - w0)
			t.Logf("%d bytes moved, %d through read/write on this thread", moved, through)
			if viaSplice && through > 64<<10 {
				t.Errorf("splicing thread read/wrote %d bytes; want almost none of the %d", through, size)
			}
			if !viaSplice && through < 2*size {
				t.Errorf("copying thread read/wrote %d bytes; want at least %d (is the counter alive?)", through, 2*size)
			}
		})
	}
}

func TestSplicerFillNeedsEmptyPipe(t *testing.T) {
	srcW, srcR := tcpPair(t)
	if _, err := srcW.Write([]byte("0123456789")); err != nil {
		t.Fatal(err)
	}
	s, err := NewSplicer()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if n, err := s.Fill(srcR, 4); n != 4 || err != nil || s.Buffered() != 4 {
		t.Fatalf("Fill = %d, %v (buffered %d); want 4 bytes", n, err, s.Buffered())
	}
	if _, err := s.Fill(srcR, 4); err == nil {
		t.Fatal("Fill into a non-empty pipe succeeded")
	}
}
