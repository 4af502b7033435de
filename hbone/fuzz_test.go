package hbone

import (
	"bytes"
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// fuzzFrames turns fuzz input into a frame sequence: per frame one byte type (mod 10),
// one byte flags, one byte stream id (mod 8), one byte length, then that many payload bytes.
func fuzzFrames(data []byte, f func(typ http2.FrameType, flags http2.Flags, id uint32, payload []byte) error) {
	for len(data) >= 4 {
		typ, flags, id, n := http2.FrameType(data[0]%10), http2.Flags(data[1]), uint32(data[2]%8), int(data[3])
		data = data[4:]
		n = min(n, len(data))
		if f(typ, flags, id, data[:n]) != nil {
			return
		}
		data = data[n:]
	}
}

func fuzzSeed(frames ...[]byte) []byte { return bytes.Join(frames, nil) }

func seedFrame(typ http2.FrameType, flags http2.Flags, id uint32, payload []byte) []byte {
	return append([]byte{byte(typ), byte(flags), byte(id), byte(len(payload))}, payload...)
}

func connectBlock() []byte {
	var b bytes.Buffer
	enc := hpack.NewEncoder(&b)
	enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	enc.WriteField(hpack.HeaderField{Name: ":authority", Value: "10.0.0.1:80"})
	return b.Bytes()
}

func FuzzServer(f *testing.F) {
	hdr := seedFrame(http2.FrameHeaders, http2.FlagHeadersEndHeaders, 1, connectBlock())
	f.Add(fuzzSeed(hdr, seedFrame(http2.FrameData, 0, 1, []byte("hello")), seedFrame(http2.FrameData, http2.FlagDataEndStream, 1, nil)))
	f.Add(fuzzSeed(hdr, seedFrame(http2.FrameRSTStream, 0, 1, []byte{0, 0, 0, 8})))
	f.Add(fuzzSeed(hdr, seedFrame(http2.FrameWindowUpdate, 0, 1, []byte{0x7f, 0xff, 0xff, 0xff})))
	f.Add(fuzzSeed(seedFrame(http2.FrameHeaders, 0, 1, connectBlock()[:3]), seedFrame(http2.FrameContinuation, http2.FlagContinuationEndHeaders, 1, connectBlock()[3:])))
	f.Add(fuzzSeed(seedFrame(http2.FramePing, 0, 0, make([]byte, 8)), seedFrame(http2.FrameSettings, 0, 0, []byte{0, 4, 0, 0, 0, 0})))
	f.Add(fuzzSeed(hdr, seedFrame(http2.FrameHeaders, http2.FlagHeadersEndHeaders|http2.FlagHeadersEndStream, 1, nil)))
	f.Add(fuzzSeed(seedFrame(http2.FrameGoAway, 0, 0, make([]byte, 8)), hdr))
	f.Fuzz(func(t *testing.T, data []byte) {
		leaktest.Check(t)
		a, b := net.Pipe()
		srv := NewServer(ServerConfig{Config: Config{PingInterval: time.Hour}}, echo)
		done := make(chan error, 1)
		go func() { done <- srv.ServeConn(context.Background(), a) }()
		fr := http2.NewFramer(b, b)
		drained := make(chan struct{})
		go func() { io.Copy(io.Discard, b); close(drained) }()
		b.SetWriteDeadline(time.Now().Add(5 * time.Second))
		if _, err := b.Write([]byte(http2.ClientPreface)); err == nil && fr.WriteSettings() == nil {
			fuzzFrames(data, func(typ http2.FrameType, flags http2.Flags, id uint32, payload []byte) error {
				return fr.WriteRawFrame(typ, flags, id, payload)
			})
		}
		b.Close()
		<-drained
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("ServeConn did not return after the peer closed")
		}
	})
}
