// Package cnirules holds the iptables rules istio-cni installs in a pod's network namespace
// next to a dedicated ztunnel, so that the namespace tests and the load generator's
// capture topology redirect traffic the same way, from one list.
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
