// Package netnstest builds network namespaces for tests: several "hosts" joined by veth pairs
// on one machine (New, Link), for redirection and cross-node tests, and unnamed namespaces
// that stand in for a pod's (NewAnonymous). They need root, and New and Link iproute2's
// `ip`; Require and RequireRoot skip the test with a clear message otherwise. Named
// namespaces are called gozt-<name>-<pid>-<n> and deleted when the test ends.
//
// Production code enters namespaces with package netns; nothing but tests imports this one.
package netnstest

import (
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/netns"
)

// RequireRoot skips t unless it runs as root on Linux, which entering and creating
// namespaces needs.
func RequireRoot(t testing.TB) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("netns: network namespaces need Linux")
	}
	if os.Geteuid() != 0 {
		t.Skip("netns: needs root to create network namespaces (CI runs as root)")
	}
}

// Require skips t unless namespaces can be made here (root, Linux, `ip` installed). Each
// tool named in tools (e.g. "iptables", "curl") must be on PATH too.
func Require(t testing.TB, tools ...string) {
	t.Helper()
	RequireRoot(t)
	for _, tool := range append([]string{"ip"}, tools...) {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("netns: %s is not installed (apt-get install -y iproute2 iptables curl; .ci/run does)", tool)
		}
	}
}

// NS is one network namespace.
type NS struct {
	Name string
}

var seq atomic.Int32

// New creates a namespace with loopback up and deletes it when t ends.
func New(t testing.TB, name string) *NS {
	t.Helper()
	ns := &NS{Name: fmt.Sprintf("gozt-%s-%d-%d", name, os.Getpid(), seq.Add(1))}
	run(t, "ip", "netns", "add", ns.Name)
	t.Cleanup(func() { _ = exec.Command("ip", "netns", "del", ns.Name).Run() })
	ns.MustExec(t, "ip", "link", "set", "lo", "up")
	return ns
}

// Exec runs a command inside the namespace (ip netns exec) and returns its combined output.
func (ns *NS) Exec(args ...string) ([]byte, error) {
	return exec.Command("ip", append([]string{"netns", "exec", ns.Name}, args...)...).CombinedOutput()
}

// MustExec is Exec that fails t on error.
func (ns *NS) MustExec(t testing.TB, args ...string) string {
	t.Helper()
	out, err := ns.Exec(args...)
	if err != nil {
		t.Fatalf("netns %s: %s: %v\n%s", ns.Name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Do runs fn on an OS thread switched into the namespace (see netns.NetNS.Do).
func (ns *NS) Do(fn func() error) error {
	n, err := netns.Open("/var/run/netns/" + ns.Name)
	if err != nil {
		return err
	}
	defer n.Close()
	return n.Do(fn)
}

// Link joins a and b with a veth pair and gives each end an address in CIDR form
// ("10.0.0.1/24"); both ends are brought up.
func Link(t testing.TB, a *NS, aAddr string, b *NS, bAddr string) {
	t.Helper()
	id := seq.Add(1)
	va, vb := fmt.Sprintf("gz%da%d", os.Getpid()%100000, id), fmt.Sprintf("gz%db%d", os.Getpid()%100000, id)
	run(t, "ip", "link", "add", va, "type", "veth", "peer", "name", vb)
	run(t, "ip", "link", "set", va, "netns", a.Name)
	run(t, "ip", "link", "set", vb, "netns", b.Name)
	a.MustExec(t, "ip", "addr", "add", aAddr, "dev", va)
	b.MustExec(t, "ip", "addr", "add", bAddr, "dev", vb)
	a.MustExec(t, "ip", "link", "set", va, "up")
	b.MustExec(t, "ip", "link", "set", vb, "up")
}

func run(t testing.TB, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("netns: %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// WaitDAD waits until no IPv6 address in the namespace is tentative: until a new link's
// link-local address has passed duplicate address detection (about 1 s), the first IPv6
// connection across a router waits a second for its SYN's retransmission. Addresses added
// with nodad skip it; link-local ones cannot.
func (ns *NS) WaitDAD(t testing.TB) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); strings.TrimSpace(ns.MustExec(t, "ip", "-6", "addr", "show", "tentative")) != ""; {
		if time.Now().After(deadline) {
			t.Fatalf("netns %s: IPv6 addresses still tentative after 10s", ns.Name)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// AddAddrBeside adds cidr to the namespace's link that holds the address beside (say, an
// IPv6 address next to a veth's IPv4 one), with nodad: usable at once.
func (ns *NS) AddAddrBeside(t testing.TB, beside, cidr string) {
	t.Helper()
	// "3: gz1a2    inet 10.31.1.2/24 ..."
	f := strings.Fields(ns.MustExec(t, "ip", "-o", "addr", "show", "to", beside))
	if len(f) < 2 {
		t.Fatalf("netns %s: no link with %s", ns.Name, beside)
	}
	ns.MustExec(t, "ip", "addr", "add", cidr, "dev", f[1], "nodad")
}
