// Command zbench is gozt's load generator: an echo/sink/source server, scenarios that drive
// any TCP path (direct, or through a SOCKS5 proxy such as ztunnel's), and a suite that starts
// two ztunnel nodes, peer tunnels and (as root) the iptables capture path between network
// namespaces, and compares them in one table. See package bench.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/gozt/gozt/bench"
)

const usage = `usage:
  zbench serve --listen ADDR [--mode echo|sink|source]
  zbench SCENARIO --target HOST:PORT [--socks5 HOST:PORT] [flags]   SCENARIO: %s
  zbench suite [--short] [--peers] [--json FILE] [--svg FILE] [flags]
run "zbench COMMAND -h" for a command's flags
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "zbench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	if len(args) == 0 {
		fmt.Fprintf(os.Stderr, usage, strings.Join(bench.Scenarios, "|"))
		return errors.New("no command")
	}
	cmd, args := args[0], args[1:]
	switch cmd {
	case "serve":
		return serve(ctx, args)
	case "suite":
		return suite(ctx, args)
	case "help", "-h", "--help":
		fmt.Fprintf(os.Stdout, usage, strings.Join(bench.Scenarios, "|"))
		return nil
	}
	for _, s := range bench.Scenarios {
		if s == cmd {
			return scenario(ctx, cmd, args)
		}
	}
	fmt.Fprintf(os.Stderr, usage, strings.Join(bench.Scenarios, "|"))
	return fmt.Errorf("unknown command %q", cmd)
}

func serve(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8080", "address to listen on")
	mode := fs.String("mode", "echo", "echo: return every byte; sink: check and count (for throughput --direction up); source: send the pattern (--direction down)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	s, err := bench.Listen(*listen, bench.ServerConfig{Mode: bench.Mode(*mode)})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "zbench: %s server on %s\n", *mode, s.Addr())
	<-ctx.Done()
	return s.Close()
}

// pidList is a repeatable --pid flag: PID or NAME=PID, also comma-separated.
type pidList []bench.Proc

func (p *pidList) String() string { return fmt.Sprint(*p) }

func (p *pidList) Set(v string) error {
	for item := range strings.SplitSeq(v, ",") {
		name, num, ok := strings.Cut(item, "=")
		if !ok {
			name, num = "", item
		}
		pid, err := strconv.Atoi(strings.TrimSpace(num))
		if err != nil || pid <= 0 {
			return fmt.Errorf("bad pid %q", item)
		}
		if name == "" {
			name = "pid" + num
			if b, err := os.ReadFile("/proc/" + num + "/comm"); err == nil {
				name = strings.TrimSpace(string(b)) + "[" + num + "]"
			}
		}
		*p = append(*p, bench.Proc{Name: name, PID: pid})
	}
	return nil
}

func scenario(ctx context.Context, name string, args []string) error {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	var t bench.Target
	var o bench.Options
	var pids pidList
	fs.StringVar(&t.Addr, "target", "", "backend host:port (a domain name is passed to the SOCKS5 proxy unresolved)")
	fs.StringVar(&t.SOCKS5, "socks5", "", "SOCKS5 proxy host:port to connect through (ztunnel: 127.0.0.1:15080)")
	fs.DurationVar(&t.DialTimeout, "dial-timeout", 5*time.Second, "per-connection setup timeout")
	fs.DurationVar(&o.Duration, "duration", 0, "how long to run (idle: how long to hold); default 5s (idle 1s)")
	fs.IntVar(&o.Count, "count", 0, "pingpong, connrate: stop after this many operations instead")
	fs.IntVar(&o.Conns, "conns", 0, "parallel connections (default 1; connrate 4; idle 1000)")
	fs.IntVar(&o.Payload, "payload", 0, "bytes per request, or per write for throughput (default 1024; throughput 262144)")
	fs.Float64Var(&o.Rate, "rate", 0, "rr: requests per second over all connections (default 1000)")
	fs.StringVar(&o.Direction, "direction", "", "throughput: echo (default), up (to a sink server), down (from a source server)")
	fs.Var(&pids, "pid", "proxy process to charge CPU and memory to: PID or NAME=PID, repeatable or comma-separated")
	asJSON := fs.Bool("json", false, "print the result as JSON")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if t.Addr == "" {
		return errors.New("--target is required")
	}
	o.Procs = pids
	res, err := bench.Run(ctx, name, t, o)
	if res != nil {
		if *asJSON {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			enc.Encode(res)
		} else {
			bench.WriteResult(os.Stdout, res)
		}
	}
	return err
}

func suite(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("suite", flag.ContinueOnError)
	var cfg bench.SuiteConfig
	fs.BoolVar(&cfg.Short, "short", false, "quick preset: 1 repetition of 1s runs, 300 idle connections (what make bench runs)")
	fs.BoolVar(&cfg.Peers, "peers", false, "also measure the tunnel chains peers.sh starts (relay, stunnel, haproxy, nginx, ghostunnel)")
	fs.StringVar(&cfg.PeersScript, "peers-script", "", "peers.sh to run (default <repo>/../shared/bench/peers.sh)")
	fs.StringVar(&cfg.Repo, "repo", "", "repository root (default: found from the working directory)")
	fs.StringVar(&cfg.Ztunnel, "ztunnel", "", "ztunnel binary to run (default: go build ./cmd/ztunnel)")
	fs.StringVar(&cfg.ZtunnelRS, "ztunnel-rs", os.Getenv("ZTUNNEL_RS"), "Rust ztunnel binary (istio/ztunnel) to measure beside gozt on the namespace and in-pod paths; never built here (default $ZTUNNEL_RS; empty: those paths are left out)")
	fs.BoolVar(&cfg.NoZtunnel, "no-ztunnel", false, "leave the ztunnel path (two nodes on loopback, via SOCKS5) out")
	fs.BoolVar(&cfg.NoKernelTLS, "no-kernel-tls", false, "leave the ztunnel-ktls path out (two nodes with KERNEL_TLS=true; it runs only where the kernel has kernel TLS, and the ztunnel path then keeps TLS in user space for comparison)")
	fs.BoolVar(&cfg.NoCapture, "no-capture", false, "leave the network-namespace paths out (capture: iptables redirection to ztunnel over a veth pair; veth: its baseline); they need root, ip and iptables")
	fs.StringVar(&cfg.EchoAddr, "echo", "", "echo server address (default 127.0.0.3:8080, the server workload's)")
	only := fs.String("only", "", "run only these cases, comma-separated: rr, idle, pingpong, connrate, throughput/1, throughput/8 (throughput: both)")
	fs.IntVar(&cfg.Reps, "reps", 0, "repetitions of every run; the table shows medians (default 3, short 1)")
	fs.DurationVar(&cfg.Duration, "duration", 0, "length of each run (default 5s, short 1s)")
	fs.IntVar(&cfg.IdleConns, "idle-conns", 0, "connections the idle case holds (default 1000, short 300)")
	fs.StringVar(&cfg.WorkDir, "workdir", "", "keep logs, binaries and the CA here (default: a temporary directory, removed)")
	jsonPath := fs.String("json", "", "also write the report as JSON to this file (- for stdout, instead of the table)")
	svgPath := fs.String("svg", "", "also write a chart of the latency distributions to this SVG file")
	verbose := fs.Bool("v", false, "show tool output (peers.sh) and per-run failures as they happen")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *only != "" {
		cfg.Only = strings.Split(*only, ",")
	}
	if fi, err := os.Stderr.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		cfg.Progress = os.Stderr
	}
	cfg.Log = io.Discard
	if *verbose {
		cfg.Log = os.Stderr
	}
	rep, err := bench.RunSuite(ctx, cfg)
	if rep == nil {
		return err
	}
	if *jsonPath != "-" {
		rep.WriteTable(os.Stdout)
	}
	if *jsonPath != "" {
		if werr := writeFile(*jsonPath, rep.WriteJSON); werr != nil {
			return errors.Join(err, werr)
		}
	}
	if *svgPath != "" {
		if werr := writeFile(*svgPath, rep.WriteSVG); werr != nil {
			return errors.Join(err, werr)
		}
	}
	return err
}

// writeFile writes with f to path, or to stdout when path is "-".
func writeFile(path string, f func(io.Writer) error) error {
	if path == "-" {
		return f(os.Stdout)
	}
	out, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := f(out); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
