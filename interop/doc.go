// Package interop runs gozt beside the Rust ztunnel (istio/ztunnel), the program gozt's users
// would otherwise run, as real processes in network namespaces, and checks that the two speak
// the same protocol and tell an operator the same things.
//
// The tests need the Rust ztunnel's binary, by path: ZTUNNEL_RS=/path/to/ztunnel (make
// interop-rs ZTUNNEL_RS=...). Without it, or without root and iproute2/iptables, they skip
// with one line saying what is missing. gozt's binary is built from this repository.
//
// Every pair of nodes — gozt→gozt, gozt→rs, rs→gozt, rs→rs — gets one Istio-CA-protocol server
// (identity/ca/catest) that both programs' CA clients use, one local config file that both
// read, and the same traffic. What must agree is asserted; where the two differ on purpose,
// the difference is listed in testdata/differences.txt with its reason, and a difference not
// on that list fails the test.
package interop
