package scaletest

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
)

// xdsControl is tools/xdscontrol: a delta ADS server built on go-control-plane (a
// LinearCache per type behind its delta server), in a process of its own at nice 19, driven
// over its standard input (see its doc comment). It is the control plane nobody here wrote:
// it orders a response's resources by map iteration and versions each by a SHA-256 of its
// content, so a push of the same content sends nothing.
type xdsControl struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	in    *bufio.Writer
	addr  string
	read  sync.WaitGroup
	// pushed carries the replies to update commands, one per command; closed when the
	// process's output ends.
	pushed chan string

	mu       sync.Mutex
	answered map[string]answer
	ackedAt  map[string]time.Time // "stream.nonce" -> when its ACK arrived
	versions int                  // the last Address subscription's initial resource versions
}

// xdsControlBinary is $XDSCONTROL or the repository's .tools/xdscontrol (make xdscontrol).
func xdsControlBinary() (string, error) {
	p := os.Getenv("XDSCONTROL")
	if p == "" {
		p = "../../.tools/xdscontrol"
	}
	p, err := filepath.Abs(p)
	if err != nil {
		return "", err
	}
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("go-control-plane's server is not built: run `make xdscontrol` (tools/xdscontrol into .tools/), or set XDSCONTROL: %w", err)
	}
	return p, nil
}

// startXDSControl starts bin serving m on a loopback port.
func startXDSControl(t testing.TB, bin string, m *mesh) *xdsControl {
	t.Helper()
	x := &xdsControl{
		cmd:    exec.Command("nice", "-n", "19", bin, "-addr", "127.0.0.1:0"),
		pushed: make(chan string, 1), answered: map[string]answer{}, ackedAt: map[string]time.Time{},
	}
	x.cmd.Stderr = os.Stderr
	out, err := x.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if x.stdin, err = x.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	x.in = bufio.NewWriterSize(x.stdin, 1<<20)
	if err := x.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(out)
	if !sc.Scan() || !strings.HasPrefix(sc.Text(), "ready ") {
		x.stop()
		t.Fatalf("xdscontrol did not start: %q %v", sc.Text(), sc.Err())
	}
	x.addr = strings.TrimPrefix(sc.Text(), "ready ")
	x.read.Add(1)
	go x.events(sc)
	for _, set := range []struct {
		typ string
		rs  []*discoverypb.Resource
	}{{xdspb.AddressType, m.addresses}, {xdspb.AuthorizationType, m.policies}} {
		if _, err := x.push(set.typ, set.rs, nil); err != nil && !errors.Is(err, errUnchanged) {
			x.stop()
			t.Fatalf("xdscontrol: loading the mesh: %v", err)
		}
	}
	return x
}

// events reads the process's reports until its output ends.
func (x *xdsControl) events(sc *bufio.Scanner) {
	defer x.read.Done()
	defer close(x.pushed)
	for sc.Scan() {
		line := sc.Text()
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		x.mu.Lock()
		switch f[0] {
		case "answered": // TYPE NONCE RESOURCES BYTES START
			if len(f) == 6 {
				n, _ := strconv.Atoi(f[3])
				b, _ := strconv.Atoi(f[4])
				x.answered[f[1]] = answer{start: unixNano(f[5]), nonce: f[2], resources: n, bytes: b}
			}
		case "acked": // NONCE AT NACK
			if len(f) >= 3 {
				x.ackedAt[f[1]] = unixNano(f[2])
			}
		case "stream": // VERSIONS
			if len(f) == 2 {
				x.versions, _ = strconv.Atoi(f[1])
			}
		}
		x.mu.Unlock()
		if f[0] == "pushed" {
			x.pushed <- line
		}
	}
}

func unixNano(s string) time.Time {
	n, _ := strconv.ParseInt(s, 10, 64)
	return time.Unix(0, n)
}

func (x *xdsControl) push(typ string, update []*discoverypb.Resource, remove []string) (time.Duration, error) {
	fmt.Fprintf(x.in, "update %s %d %d\n", typ, len(update), len(remove))
	var buf [binary.MaxVarintLen64]byte
	put := func(b []byte) {
		x.in.Write(buf[:binary.PutUvarint(buf[:], uint64(len(b)))])
		x.in.Write(b)
	}
	for _, r := range update {
		put([]byte(r.GetName()))
		put(r.GetResource().GetValue())
	}
	for _, n := range remove {
		put([]byte(n))
	}
	if err := x.in.Flush(); err != nil {
		return 0, fmt.Errorf("xdscontrol: %w", err)
	}
	line, ok := <-x.pushed
	if !ok {
		return 0, errors.New("xdscontrol exited")
	}
	// pushed TYPE NONCE START ACK NACK
	f := strings.SplitN(line, " ", 6)
	if len(f) != 6 {
		return 0, fmt.Errorf("xdscontrol: bad reply %q", line)
	}
	if f[2] == "-" {
		return 0, errUnchanged
	}
	if f[5] != "-" {
		msg, _ := strconv.Unquote(f[5])
		return 0, errors.New("NACK: " + msg)
	}
	return unixNano(f[4]).Sub(unixNano(f[3])), nil
}

func (x *xdsControl) drop() {
	fmt.Fprintln(x.in, "drop")
	_ = x.in.Flush()
}

func (x *xdsControl) answeredAcked(typ string) (answer, time.Time) {
	x.mu.Lock()
	defer x.mu.Unlock()
	a := x.answered[typ]
	return a, x.ackedAt[a.nonce]
}

func (x *xdsControl) reconnectVersions() int {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.versions
}

// stop ends the process: it exits when its standard input closes.
func (x *xdsControl) stop() {
	x.stdin.Close()
	x.read.Wait()
	_ = x.cmd.Wait()
}
