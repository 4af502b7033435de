//go:build race

package proxy_test

// raceEnabled: under the race detector sync.Pool drops items at random and the heap holds
// more per object, so memory bounds measured without it are loosened.
const raceEnabled = true
