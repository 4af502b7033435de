package hbone

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

const benchChunk = 256 << 10

func reportGbps(b *testing.B, bytes int64, d time.Duration) {
	b.ReportMetric(float64(bytes)*8/d.Seconds()/1e9, "Gbit/s")
}

// tcpPair is a connected loopback *net.TCPConn pair, closed when the test ends.
func tcpPair(b testing.TB) (*net.TCPConn, *net.TCPConn) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	ch := make(chan net.Conn, 1)
	go func() { c, _ := ln.Accept(); ch <- c }()
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	a, d := c.(*net.TCPConn), (<-ch).(*net.TCPConn)
	b.Cleanup(func() { a.Close(); d.Close() })
	return a, d
}

// bulkPair sends b.N chunks from w and waits until r has read them all.
func bulkPair(b *testing.B, w io.Writer, r io.Reader) {
	buf := make([]byte, benchChunk)
	total := int64(b.N) * benchChunk
	done := make(chan int64, 1)
	go func() {
		n, _ := io.CopyN(io.Discard, r, total)
		done <- n
	}()
	b.SetBytes(benchChunk)
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		if _, err := w.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	if n := <-done; n != total {
		b.Fatalf("received %d of %d bytes", n, total)
	}
	reportGbps(b, total, time.Since(start))
}

func BenchmarkBulk(b *testing.B) {
	b.Run("tcp", func(b *testing.B) {
		c, s := tcpPair(b)
		bulkPair(b, c, s)
	})
	b.Run("tls", func(b *testing.B) {
		c, s := tlsPair(b)
		defer c.Close()
		defer s.Close()
		bulkPair(b, c, s)
	})
	for _, streams := range []int{1, 8} {
		name := "hbone-1stream"
		if streams == 8 {
			name = "hbone-8streams"
		}
		b.Run(name, func(b *testing.B) {
			got := make(chan int64, streams)
			e := newEnv(b, ServerConfig{}, func(r *Request) {
				s, err := r.Accept(nil)
				if err != nil {
					return
				}
				defer s.Close()
				n, _ := io.Copy(io.Discard, s)
				got <- n
			})
			ss := make([]*Stream, streams)
			for i := range ss {
				ss[i] = e.dial(b, "10.0.0.1:80")
				defer ss[i].Close()
			}
			buf := make([]byte, benchChunk)
			b.SetBytes(benchChunk)
			b.ReportAllocs()
			b.ResetTimer()
			start := time.Now()
			var wg sync.WaitGroup
			for i, s := range ss {
				n := b.N / streams
				if i < b.N%streams {
					n++
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range n {
						if _, err := s.Write(buf); err != nil {
							b.Error(err)
							return
						}
					}
					s.CloseWrite()
				}()
			}
			wg.Wait()
			var total int64
			for range streams {
				total += <-got
			}
			if total != int64(b.N)*benchChunk {
				b.Fatalf("received %d of %d bytes", total, int64(b.N)*benchChunk)
			}
			reportGbps(b, total, time.Since(start))
		})
	}
}

// BenchmarkRoundTrip1K is a 1 KiB request and 1 KiB echo per op.
func BenchmarkRoundTrip1K(b *testing.B) {
	rt := func(b *testing.B, c io.ReadWriter) {
		out := make([]byte, 1024)
		in := make([]byte, 1024)
		b.ReportAllocs()
		b.ResetTimer()
		start := time.Now()
		for range b.N {
			if _, err := c.Write(out); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, in); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/rt")
	}
	b.Run("tcp", func(b *testing.B) {
		c, s := tcpPair(b)
		go io.Copy(s, s)
		rt(b, c)
	})
	b.Run("tls", func(b *testing.B) {
		c, s := tlsPair(b)
		defer c.Close()
		defer s.Close()
		go io.Copy(s, s)
		rt(b, c)
	})
	b.Run("hbone", func(b *testing.B) {
		e := newEnv(b, ServerConfig{}, echo)
		s := e.dial(b, "10.0.0.1:80")
		defer s.Close()
		rt(b, s)
	})
}

// BenchmarkNewStream opens, half-closes both ways and closes one stream per op on a warm
// pooled connection.
func BenchmarkNewStream(b *testing.B) {
	e := newEnv(b, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		s.CloseWrite()
		io.Copy(io.Discard, s)
		s.Close()
	})
	e.dial(b, "10.0.0.1:80").Close()
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for range b.N {
		s, err := e.pool.Dial(context.Background(), e.key, "10.0.0.1:80", nil)
		if err != nil {
			b.Fatal(err)
		}
		s.CloseWrite()
		io.Copy(io.Discard, s)
		s.Close()
	}
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "streams/s")
}

// BenchmarkRoundTrip1KViaTCP adds the server-side TCP leg of a real inbound proxy:
// client stream -> HBONE server -> TCP echo backend and back, with and without the
// frame reader's direct write into the backend socket.
func BenchmarkRoundTrip1KViaTCP(b *testing.B) {
	for _, direct := range []bool{false, true} {
		name := "queued"
		if direct {
			name = "direct"
		}
		b.Run(name, func(b *testing.B) {
			defer func(old bool) { directDelivery = old }(directDelivery)
			directDelivery = direct
			backend, stop := tcpEcho(b)
			defer stop()
			e := newEnv(b, ServerConfig{}, proxyTo(backend))
			s := e.dial(b, "10.0.0.1:80")
			defer s.Close()
			out := make([]byte, 1024)
			in := make([]byte, 1024)
			b.ReportAllocs()
			b.ResetTimer()
			start := time.Now()
			for range b.N {
				s.Write(out)
				if _, err := io.ReadFull(s, in); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(time.Since(start).Microseconds())/float64(b.N), "µs/rt")
		})
	}
}

// BenchmarkBulkRatio alternates 8 MiB over plain crypto/tls and 8 MiB over one HBONE
// stream per op, so both see the same machine load, and reports HBONE's one-stream
// throughput as a fraction of crypto/tls's (the bar is >= 0.85).
func BenchmarkBulkRatio(b *testing.B) {
	const burst = 8 << 20
	tc, ts := tlsPair(b)
	defer tc.Close()
	defer ts.Close()
	got := make(chan int64)
	e := newEnv(b, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		for {
			n, err := io.CopyN(io.Discard, s, burst)
			if err != nil {
				return
			}
			got <- n
		}
	})
	hs := e.dial(b, "10.0.0.1:80")
	defer hs.Close()
	tlsDone := make(chan int64)
	go func() {
		for {
			n, err := io.CopyN(io.Discard, ts, burst)
			if err != nil {
				close(tlsDone)
				return
			}
			tlsDone <- n
		}
	}()
	buf := make([]byte, benchChunk)
	send := func(w io.Writer, done <-chan int64) time.Duration {
		start := time.Now()
		for range burst / benchChunk {
			if _, err := w.Write(buf); err != nil {
				b.Fatal(err)
			}
		}
		<-done
		return time.Since(start)
	}
	var tTLS, tHB time.Duration
	b.SetBytes(2 * burst)
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			tTLS += send(tc, tlsDone)
			tHB += send(hs, got)
		} else {
			tHB += send(hs, got)
			tTLS += send(tc, tlsDone)
		}
	}
	b.ReportMetric(float64(tTLS)/float64(tHB), "hbone/tls")
	b.ReportMetric(float64(b.N)*burst*8/tTLS.Seconds()/1e9, "tls-Gbit/s")
	b.ReportMetric(float64(b.N)*burst*8/tHB.Seconds()/1e9, "hbone-Gbit/s")
}
