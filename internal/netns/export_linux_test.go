//go:build linux

package netns

// CheckThread is checkThread, for the external test of CheckCapabilities.
var CheckThread = checkThread
