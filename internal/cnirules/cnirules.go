// Package cnirules holds the iptables rules istio-cni installs in a pod's network namespace,
// so that the namespace tests and the load generator's capture topology redirect traffic
// the same way, from one list: Redirect, a simplified set next to a dedicated ztunnel, and
// istio-cni's in-pod rules exactly, for both IP families (iptables and ip6tables) in both
// shapes its releases have used: REDIRECT in nat (InPod, InPod6: istio 1.24 and later) and
// TPROXY in mangle (InPodTPROXY, InPodTPROXY6: 1.22 and 1.23), with their policy routing
// (InPodRoutes, InPodRoutes6).
package cnirules

// Redirect returns the nat-table rules, each the arguments that follow
// `iptables -w -t nat`: the pod's outbound TCP goes to 15001 unless it carries ztunnel's
// packet mark, stays on loopback (the family's loopback CIDR, e.g. "127.0.0.0/8" or
// "::1/128") or goes to excludedPort (the excludeOutboundPorts annotation); inbound TCP
// from outside goes to 15006 except HBONE on 15008, which ztunnel serves directly, and
// excludedPort (excludeInboundPorts).
func Redirect(mark, loopback, excludedPort string) [][]string {
	return [][]string{
		{"-N", "GOZT_OUTPUT"},
		{"-A", "GOZT_OUTPUT", "-m", "mark", "--mark", mark, "-j", "RETURN"},
		{"-A", "GOZT_OUTPUT", "-d", loopback, "-j", "RETURN"},
		{"-A", "GOZT_OUTPUT", "-p", "tcp", "--dport", excludedPort, "-j", "RETURN"},
		{"-A", "GOZT_OUTPUT", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001"},
		{"-A", "OUTPUT", "-p", "tcp", "-j", "GOZT_OUTPUT"},
		{"-N", "GOZT_PREROUTING"},
		{"-A", "GOZT_PREROUTING", "-p", "tcp", "--dport", "15008", "-j", "RETURN"},
		{"-A", "GOZT_PREROUTING", "-p", "tcp", "--dport", excludedPort, "-j", "RETURN"},
		{"-A", "GOZT_PREROUTING", "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15006"},
		{"-A", "PREROUTING", "!", "-i", "lo", "-p", "tcp", "-j", "GOZT_PREROUTING"},
	}
}

// In-pod marks and addresses, as istio-cni's in-pod rules use them.
const (
	InPodMark     = "0x539/0xfff" // ztunnel's own sockets (PACKET_MARK 1337)
	InPodConnMark = "0x111/0xfff" // a connection of ztunnel's, restored for policy routing
	ProbeSNAT     = "169.254.7.127"
	// ProbeSNAT6 is the IPv6 probe SNAT address (HOST_PROBE_SNAT_IPV6's default).
	ProbeSNAT6 = "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
)

// The two families' rules differ only in these addresses.
type family struct{ loopback, probe, anyRoute, ipFlag string }

var (
	ipv4 = family{loopback: "127.0.0.1/32", probe: ProbeSNAT, anyRoute: "0.0.0.0/0", ipFlag: "-4"}
	ipv6 = family{loopback: "::1/128", probe: ProbeSNAT6, anyRoute: "::/0", ipFlag: "-6"}
)

// InPod returns the IPv4 iptables rules istio-cni installs in each pod's network namespace
// in in-pod ("shared") mode, each the arguments that follow `iptables -w`: chains
// ISTIO_PRERT and ISTIO_OUTPUT in the mangle, nat and raw tables, hooked from PREROUTING
// and OUTPUT, holding exactly the rules of istio-cni's default.golden (istio/istio
// cni/pkg/iptables/testdata; the REDIRECT shape of istio 1.24 and later).
// Outbound TCP goes to 15001, inbound TCP other than HBONE to 15006, DNS to 15053, unless
// the packet carries ztunnel's mark; kubelet probes (SNATed to ProbeSNAT) pass.
func InPod() [][]string { return inPod(ipv4) }

// InPod6 returns the IPv6 counterpart of InPod, each the arguments that follow
// `ip6tables -w`: the ip6tables half of istio-cni's default_ipv6.golden, which istio-cni
// installs beside InPod in a dual-stack or IPv6 cluster. Only the loopback (::1/128) and the
// probe address (ProbeSNAT6) differ.
func InPod6() [][]string { return inPod(ipv6) }

func inPod(f family) [][]string {
	var rules [][]string
	for _, table := range []string{"mangle", "nat", "raw"} {
		rules = append(rules,
			[]string{"-t", table, "-N", "ISTIO_PRERT"},
			[]string{"-t", table, "-N", "ISTIO_OUTPUT"},
			[]string{"-t", table, "-A", "PREROUTING", "-j", "ISTIO_PRERT"},
			[]string{"-t", table, "-A", "OUTPUT", "-j", "ISTIO_OUTPUT"})
	}
	return append(rules,
		[]string{"-t", "mangle", "-A", "ISTIO_PRERT", "-m", "mark", "--mark", InPodMark, "-j", "CONNMARK", "--set-xmark", InPodConnMark},
		[]string{"-t", "mangle", "-A", "ISTIO_OUTPUT", "-m", "connmark", "--mark", InPodConnMark, "-j", "CONNMARK", "--restore-mark", "--nfmask", "0xffffffff", "--ctmask", "0xffffffff"},
		[]string{"-t", "nat", "-A", "ISTIO_PRERT", "-s", f.probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT"},
		[]string{"-t", "nat", "-A", "ISTIO_PRERT", "!", "-d", f.loopback, "-p", "tcp", "!", "--dport", "15008", "-m", "mark", "!", "--mark", InPodMark, "-j", "REDIRECT", "--to-ports", "15006"},
		[]string{"-t", "nat", "-A", "ISTIO_OUTPUT", "-d", f.probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT"},
		[]string{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-o", "lo", "-p", "udp", "-m", "mark", "!", "--mark", InPodMark, "-m", "udp", "--dport", "53", "-j", "REDIRECT", "--to-ports", "15053"},
		[]string{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-d", f.loopback, "-p", "tcp", "-m", "tcp", "--dport", "53", "-m", "mark", "!", "--mark", InPodMark, "-j", "REDIRECT", "--to-ports", "15053"},
		[]string{"-t", "nat", "-A", "ISTIO_OUTPUT", "-p", "tcp", "-m", "mark", "--mark", InPodConnMark, "-j", "ACCEPT"},
		[]string{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-d", f.loopback, "-o", "lo", "-j", "ACCEPT"},
		[]string{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-d", f.loopback, "-p", "tcp", "-m", "mark", "!", "--mark", InPodMark, "-j", "REDIRECT", "--to-ports", "15001"},
		[]string{"-t", "raw", "-A", "ISTIO_OUTPUT", "-p", "udp", "-m", "mark", "--mark", InPodMark, "-m", "udp", "--dport", "53", "-j", "CT", "--zone", "1"},
		[]string{"-t", "raw", "-A", "ISTIO_PRERT", "-p", "udp", "-m", "mark", "!", "--mark", InPodMark, "-m", "udp", "--sport", "53", "-j", "CT", "--zone", "1"},
	)
}

// InPodTPROXY returns the IPv4 in-pod rules of the istio-cni releases that hand inbound TCP
// to ztunnel with TPROXY in the mangle table instead of REDIRECT in nat (istio 1.22 and
// 1.23, their default.golden): 15008 and 15006 by TPROXY with the connection mark, outbound
// to 15001 and DNS to 15053 by REDIRECT as in InPod. ztunnel's listeners must be
// transparent to accept them, and the original destination is the accepted socket's local
// address. Same routes (InPodRoutes). istio 1.24's deprecated TPROXY_REDIRECTION option
// installs this shape too, with InPod's DNS rules in place of these.
func InPodTPROXY() [][]string { return inPodTPROXY(ipv4) }

// InPodTPROXY6 returns the IPv6 counterpart of InPodTPROXY (the ip6tables half of istio
// 1.23's default_ipv6.golden; 1.22's put a placeholder probe address there, fixed in 1.23).
// Same routes (InPodRoutes6).
func InPodTPROXY6() [][]string { return inPodTPROXY(ipv6) }

func inPodTPROXY(f family) [][]string {
	return [][]string{
		{"-t", "mangle", "-N", "ISTIO_PRERT"},
		{"-t", "nat", "-N", "ISTIO_OUTPUT"},
		{"-t", "mangle", "-N", "ISTIO_OUTPUT"},
		{"-t", "mangle", "-A", "PREROUTING", "-j", "ISTIO_PRERT"},
		{"-t", "mangle", "-A", "OUTPUT", "-j", "ISTIO_OUTPUT"},
		{"-t", "nat", "-A", "OUTPUT", "-j", "ISTIO_OUTPUT"},
		{"-t", "mangle", "-A", "ISTIO_PRERT", "-m", "mark", "--mark", InPodMark, "-j", "CONNMARK", "--set-xmark", InPodConnMark},
		{"-t", "mangle", "-A", "ISTIO_PRERT", "-s", f.probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT"},
		{"-t", "nat", "-A", "ISTIO_OUTPUT", "-d", f.probe, "-p", "tcp", "-m", "tcp", "-j", "ACCEPT"},
		{"-t", "mangle", "-A", "ISTIO_PRERT", "!", "-d", f.loopback, "-p", "tcp", "-i", "lo", "-j", "ACCEPT"},
		{"-t", "mangle", "-A", "ISTIO_PRERT", "-p", "tcp", "-m", "tcp", "--dport", "15008", "-m", "mark", "!", "--mark", InPodMark, "-j", "TPROXY", "--on-port", "15008", "--tproxy-mark", InPodConnMark},
		{"-t", "mangle", "-A", "ISTIO_PRERT", "-p", "tcp", "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"},
		{"-t", "mangle", "-A", "ISTIO_PRERT", "!", "-d", f.loopback, "-p", "tcp", "-m", "mark", "!", "--mark", InPodMark, "-j", "TPROXY", "--on-port", "15006", "--tproxy-mark", InPodConnMark},
		{"-t", "mangle", "-A", "ISTIO_OUTPUT", "-m", "connmark", "--mark", InPodConnMark, "-j", "CONNMARK", "--restore-mark", "--nfmask", "0xffffffff", "--ctmask", "0xffffffff"},
		{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-o", "lo", "-p", "udp", "-m", "udp", "--dport", "53", "-j", "REDIRECT", "--to-port", "15053"},
		{"-t", "nat", "-A", "ISTIO_OUTPUT", "-p", "tcp", "-m", "mark", "--mark", InPodConnMark, "-j", "ACCEPT"},
		{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-d", f.loopback, "-o", "lo", "-j", "ACCEPT"},
		{"-t", "nat", "-A", "ISTIO_OUTPUT", "!", "-d", f.loopback, "-p", "tcp", "-m", "mark", "!", "--mark", InPodMark, "-j", "REDIRECT", "--to-ports", "15001"},
	}
}

// InPodRoutes returns the policy routing istio-cni adds next to InPod, each the arguments
// that follow `ip`: packets of ztunnel's connections (connmark restored to the mark) look
// up table 100, which delivers everything locally, so replies to a spoofed source reach
// ztunnel's transparent sockets, and TPROXY'd packets reach the pod's listeners.
func InPodRoutes() [][]string { return inPodRoutes(ipv4) }

// InPodRoutes6 returns InPodRoutes for IPv6 (`ip -6`: the same rule, and a local ::/0 route
// in table 100). istio-cni adds them next to InPod6 or InPodTPROXY6 unless the pod's
// loopback has IPv6 disabled.
func InPodRoutes6() [][]string { return inPodRoutes(ipv6) }

func inPodRoutes(f family) [][]string {
	return [][]string{
		{f.ipFlag, "rule", "add", "fwmark", InPodConnMark, "pref", "32764", "lookup", "100"},
		{f.ipFlag, "route", "add", "local", f.anyRoute, "dev", "lo", "table", "100"},
	}
}
