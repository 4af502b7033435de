// Command zdsagent is a stand-in for istio-cni's node agent, for the in-pod demo (make
// demo-inpod): it serves ZDS on a unix socket and hands every ztunnel that connects the pods
// named on its command line, each with its network namespace. It installs no rules itself;
// -rules prints istio-cni's in-pod rules, one iptables argument list a line, for a script to
// install, and -rules6 their ip6tables counterpart for dual-stack pods.
//
//	zdsagent -uds /tmp/z.sock UID,NAMESPACE/NAME,SERVICEACCOUNT,NETNS...
//	zdsagent -rules
//	zdsagent -rules6
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/gozt/gozt/inpod/zdsagent"
	"github.com/gozt/gozt/internal/cnirules"
)

func main() {
	uds := flag.String("uds", "/var/run/ztunnel/ztunnel.sock", "the socket ztunnel connects to (its INPOD_UDS)")
	rules := flag.Bool("rules", false, "print istio-cni's in-pod iptables rules and exit")
	rules6 := flag.Bool("rules6", false, "print istio-cni's in-pod ip6tables rules and exit")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: zdsagent [-uds PATH] UID,NAMESPACE/NAME,SERVICEACCOUNT,NETNS...\n       zdsagent -rules | -rules6")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *rules || *rules6 {
		list := cnirules.InPod()
		if *rules6 {
			list = cnirules.InPod6()
		}
		for _, r := range list {
			fmt.Println(strings.Join(r, " "))
		}
		return
	}
	var pods []zdsagent.Pod
	for _, arg := range flag.Args() {
		p, err := parsePod(arg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "zdsagent:", err)
			os.Exit(2)
		}
		pods = append(pods, p)
	}
	agent, err := zdsagent.Listen(*uds, pods...)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	go func() { <-sig; agent.Close() }()
	fmt.Printf("zdsagent: serving %d pod(s) on %s\n", len(pods), *uds)
	err = agent.Serve(func(n int, err error) {
		if err != nil {
			fmt.Printf("zdsagent: ztunnel connection %d: %v\n", n, err)
			return
		}
		for _, p := range pods {
			fmt.Printf("zdsagent: ztunnel connection %d: ACK for pod %s/%s (%s)\n", n, p.Namespace, p.Name, p.NetNS)
		}
		fmt.Printf("zdsagent: ztunnel connection %d: snapshot sent and acknowledged\n", n)
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// parsePod parses UID,NAMESPACE/NAME,SERVICEACCOUNT,NETNS.
func parsePod(s string) (zdsagent.Pod, error) {
	f := strings.Split(s, ",")
	if len(f) != 4 {
		return zdsagent.Pod{}, fmt.Errorf("pod %q: want UID,NAMESPACE/NAME,SERVICEACCOUNT,NETNS", s)
	}
	ns, name, ok := strings.Cut(f[1], "/")
	if !ok {
		return zdsagent.Pod{}, fmt.Errorf("pod %q: want NAMESPACE/NAME, not %q", s, f[1])
	}
	return zdsagent.Pod{UID: f[0], Namespace: ns, Name: name, ServiceAccount: f[2], NetNS: f[3]}, nil
}
