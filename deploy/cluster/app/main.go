// Command app is the cluster's workload image (make cluster-images): one static binary that
// is the pod sandbox (pause), a TCP echo server, and the clients the cluster tests run in
// pods with kubectl exec.
//
//	app pause                  sleep until SIGTERM/SIGINT (also when run as /pause: the sandbox)
//	app init                   as pause, and reap every child: a cluster node's PID 1
//	app serve ADDR             echo every byte back on each TCP connection to ADDR
//	app echo ADDR BYTES        send BYTES of a pattern, read them back, check them; prints "ok N"
//	app loop ADDR BYTES DUR    app echo on a new connection every 50 ms for DUR (or until stdin
//	                           ends, with DUR "stdin"); prints "ok N" or
//	                           "fail N of M: first error", exits 1 on any failure
//	app resolve NAME DUR       look NAME up every 10 ms for DUR; prints "ok N" or "fail N of M: ..."
//	app hold ADDR DUR          one connection, a byte echoed every 100 ms for DUR; prints "held"
//	                           or exits 1 with "closed after Xs: error" when the connection ends
//	app traffic ADDR STREAMS   until stdin ends: app echo of 10000 bytes on a new connection every
//	                           50 ms, and STREAMS long-lived connections each echoing 16 KiB every
//	                           50 ms (a broken one is counted and dialed again); prints "streaming"
//	                           once all are open, then at the end one line of counts and the
//	                           slowest request (trafficReport)
//	app drillserve -who SVC/POD [-echo :8080] [-hash :8081] [-grace D]
//	                           the failure drills' server (drill.go)
//	app load -conn A,B -rate N -dns N1,N2 -dns-rate N -stream ADDR -streams N
//	                           the failure drills' load, until SIGTERM: a JSON line a second
//	app stall ADDR N           N TCP connections to ADDR that send a TLS ClientHello and then
//	                           nothing, held until SIGTERM (the noisy-neighbour drill)
package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

func main() {
	if filepath.Base(os.Args[0]) == "pause" { // the sandbox image runs it as /pause, no arguments
		pause()
		return
	}
	if len(os.Args) < 2 {
		usage()
	}
	var err error
	switch os.Args[1] {
	case "pause":
		pause()
	case "init":
		initLoop()
	case "serve":
		if len(os.Args) != 3 {
			usage()
		}
		err = serve(os.Args[2])
	case "echo":
		if len(os.Args) != 4 {
			usage()
		}
		var n int
		n, err = strconv.Atoi(os.Args[3])
		if err == nil {
			err = echo(os.Args[2], n)
		}
		if err == nil {
			fmt.Println("ok", n)
		}
	case "loop":
		if len(os.Args) != 5 {
			usage()
		}
		err = loop(os.Args[2], os.Args[3], os.Args[4])
	case "resolve":
		if len(os.Args) != 4 {
			usage()
		}
		err = resolve(os.Args[2], os.Args[3])
	case "traffic":
		if len(os.Args) != 4 {
			usage()
		}
		var n int
		n, err = strconv.Atoi(os.Args[3])
		if err == nil {
			err = traffic(os.Args[2], n)
		}
	case "drillserve":
		err = drillServe(os.Args[2:])
	case "load":
		err = drillLoad(os.Args[2:])
	case "stall":
		if len(os.Args) != 4 {
			usage()
		}
		var n int
		n, err = strconv.Atoi(os.Args[3])
		if err == nil {
			err = stall(os.Args[2], n)
		}
	case "hold":
		if len(os.Args) != 4 {
			usage()
		}
		err = hold(os.Args[2], os.Args[3])
	default:
		usage()
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "app:", err)
		os.Exit(1)
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: app pause | init | serve ADDR | echo ADDR BYTES | loop ADDR BYTES DURATION | resolve NAME DURATION | hold ADDR DURATION | traffic ADDR STREAMS | drillserve ... | load ... | stall ADDR N")
	os.Exit(2)
}

func pause() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}

// initLoop is PID 1 of a node's PID namespace (deploy/cluster/up.sh): it reaps the processes
// that re-parent to it (containerd's shims) until SIGTERM/SIGINT; when it returns, the kernel
// kills every process left in the namespace.
func initLoop() {
	c := make(chan os.Signal, 16)
	signal.Notify(c, syscall.SIGCHLD, syscall.SIGTERM, syscall.SIGINT)
	for sig := range c {
		if sig != syscall.SIGCHLD {
			return
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

func serve(addr string) error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); ln.Close() }()
	fmt.Println("serving", ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		go echoConn(c)
	}
}

func echoConn(c net.Conn) {
	defer c.Close()
	io.Copy(c, c)
}

// echo sends n bytes of a pattern on one connection, half-closes, and checks what comes back.
func echo(addr string, n int) error {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(30 * time.Second))
	want := make([]byte, n)
	for i := range want {
		want[i] = byte(i % 251)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := c.Write(want)
		if err == nil {
			err = c.(*net.TCPConn).CloseWrite()
		}
		errc <- err
	}()
	got, err := io.ReadAll(c)
	if werr := <-errc; werr != nil {
		return fmt.Errorf("write: %w", werr)
	}
	if err != nil {
		return fmt.Errorf("read after %d bytes: %w", len(got), err)
	}
	if !bytes.Equal(got, want) {
		return fmt.Errorf("got %d bytes back, want %d equal to what was sent", len(got), n)
	}
	return nil
}

func loop(addr, size, dur string) error {
	n, err := strconv.Atoi(size)
	if err != nil {
		return err
	}
	stop := make(chan struct{})
	if dur == "stdin" { // until stdin ends (kubectl exec -i, the caller closes it)
		go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
	} else {
		d, err := time.ParseDuration(dur)
		if err != nil {
			return err
		}
		time.AfterFunc(d, func() { close(stop) })
	}
	var total, failed int
	var first error
	for running := true; running; {
		select {
		case <-stop:
			running = false
			continue
		case <-time.After(50 * time.Millisecond):
		}
		total++
		if err := echo(addr, n); err != nil {
			failed++
			if first == nil {
				first = fmt.Errorf("%s: %w", time.Now().UTC().Format(time.RFC3339Nano), err)
			}
		}
	}
	if failed > 0 {
		return fmt.Errorf("fail %d of %d: %w", failed, total, first)
	}
	if total == 0 {
		return errors.New("no requests")
	}
	fmt.Println("ok", total)
	return nil
}

// hold keeps one connection open, checking it with a one-byte echo every 100 ms.
func hold(addr, dur string) error {
	d, err := time.ParseDuration(dur)
	if err != nil {
		return err
	}
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	b := []byte{0}
	for i := 0; time.Since(start) < d; i++ {
		b[0] = byte(i)
		c.SetDeadline(time.Now().Add(5 * time.Second))
		_, err := c.Write(b)
		if err == nil {
			_, err = io.ReadFull(c, b)
		}
		if err == nil && b[0] != byte(i) {
			err = fmt.Errorf("got byte %d, want %d", b[0], byte(i))
		}
		if err != nil {
			return fmt.Errorf("closed after %.1fs: %w", time.Since(start).Seconds(), err)
		}
		if i == 0 {
			fmt.Println("connected")
		}
		time.Sleep(100 * time.Millisecond)
	}
	fmt.Println("held")
	return nil
}

// resolve looks name up with the system resolver (the pod's resolv.conf) every 10 ms.
func resolve(name, dur string) error {
	d, err := time.ParseDuration(dur)
	if err != nil {
		return err
	}
	var total, failed int
	var first error
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
		total++
		if _, err := net.LookupHost(name); err != nil {
			failed++
			if first == nil {
				first = fmt.Errorf("%s: %w", time.Now().UTC().Format(time.RFC3339Nano), err)
			}
		}
	}
	if failed > 0 {
		return fmt.Errorf("fail %d of %d: %w", failed, total, first)
	}
	fmt.Println("ok", total)
	return nil
}

// trafficReport is what app traffic prints at the end, one line, for the cluster tests to parse.
const trafficReport = "requests %d failed %d slowest-ms %d streams %d broken %d redials-failed %d streamed %d request-errors %q stream-error %q\n"

// traffic runs a request loop and long-lived streams together until stdin ends.
func traffic(addr string, streams int) error {
	stop := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
	var mu sync.Mutex
	var requests, failed, broken, redialFailed int
	var streamed int64
	var slowest time.Duration
	var reqErrs, streamErr string // the first three failed requests, the first broken stream
	note := func(what string, err error) {
		e := fmt.Sprintf("%s %s: %v", time.Now().UTC().Format(time.RFC3339Nano), what, err)
		if what == "request" && failed <= 3 {
			reqErrs += e + "; "
		} else if what != "request" && streamErr == "" {
			streamErr = e
		}
	}
	var wg sync.WaitGroup
	opened := make(chan struct{}, streams)
	for i := 0; i < streams; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			once := false
			for {
				select {
				case <-stop:
					return
				default:
				}
				n, err := stream(addr, stop, func() {
					if !once {
						once = true
						opened <- struct{}{}
					}
				})
				mu.Lock()
				streamed += n
				if err != nil {
					if n > 0 {
						broken++
						note("stream", err)
					} else {
						redialFailed++
						note("stream dial", err)
					}
				}
				mu.Unlock()
				if err != nil {
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	}
	go func() {
		for i := 0; i < streams; i++ {
			<-opened
		}
		fmt.Println("streaming")
	}()
	for running := true; running; {
		select {
		case <-stop:
			running = false
			continue
		case <-time.After(50 * time.Millisecond):
		}
		t0 := time.Now()
		err := echo(addr, 10000)
		mu.Lock()
		slowest = max(slowest, time.Since(t0))
		requests++
		if err != nil {
			failed++
			note("request", err)
		}
		mu.Unlock()
	}
	wg.Wait()
	fmt.Printf(trafficReport, requests, failed, slowest.Milliseconds(), streams, broken, redialFailed, streamed, reqErrs, streamErr)
	return nil
}

// stream echoes 16 KiB every 50 ms on one connection until stop (then it returns a nil
// error) or a failure; it returns the bytes echoed (0: the connection never carried any).
func stream(addr string, stop <-chan struct{}, up func()) (int64, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	buf, got := make([]byte, 16<<10), make([]byte, 16<<10)
	var n int64
	for i := 0; ; i++ {
		for j := range buf {
			buf[j] = byte(i + j)
		}
		c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(buf); err != nil {
			return n, fmt.Errorf("write after %d bytes: %w", n, err)
		}
		if _, err := io.ReadFull(c, got); err != nil {
			return n, fmt.Errorf("read after %d bytes: %w", n, err)
		}
		if !bytes.Equal(got, buf) {
			return n, fmt.Errorf("corrupt echo after %d bytes", n)
		}
		n += int64(len(buf))
		if i == 0 {
			up()
		}
		select {
		case <-stop:
			return n, nil
		case <-time.After(50 * time.Millisecond):
		}
	}
}
