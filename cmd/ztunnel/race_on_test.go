//go:build race

package main

// The test binary runs with the race detector, so buildZtunnel builds the child binaries
// with it too: the packages are already compiled that way (only a link is left), and a race
// in a child process fails its exit status.
func init() { raceBuild = true }
