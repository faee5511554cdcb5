// The published FGD simulator's random draws for one run, as JSON for gpuloom's
// `simulate(..., draws=Draws(...))` (gpuloom/sim/fleet.py): its arrival order and its node
// order, from Go's own math/rand, seeded and called as that simulator calls it for
// `-tune 1.3 -tuneseed SEED --shuffle-pod=true` (hkust-adsl/kubernetes-scheduler-simulator,
// `Simulate` in pkg/simulator/core.go and the functions it calls in pkg/simulator/simulator.go):
//
//  1. rand.Seed(seed), then one rand.Int() (its debug log line's argument, evaluated at any
//     log level);
//  2. the pods sorted by name, then rand.Shuffle (SortClusterPods);
//  3. tuned to 1.3x the GPU capacity: above it, rand.Intn(len) pods removed until within;
//     below it, clones of rand.Intn(n) of the name-sorted list appended while the request so
//     far plus the clone's GPU milli per GPU stays within (TunePodsByNodeTotalResource);
//  4. ten draws the scheduler's start takes from the same source before the nodes are named
//     (found by matching the published curves: with 9 or 11 they differ; presumably the watch
//     timeouts of its informers' reflectors);
//  5. the nodes sorted by name, rand.Perm: node i of that order is named with the prefix
//     perm[i], and ties go to the smallest name, so perm[i] is its rank.
//
// Usage: go run published_draws.go PODS.csv NODES.csv SEED > draws.json
// (PODS.csv: name, num_gpu, gpu_milli columns; NODES.csv: sn, gpu columns.)
package main

import (
	"encoding/csv"
	"encoding/json"
	"log"
	"math/rand"
	"os"
	"sort"
	"strconv"
)

const tune = 1.3
const schedulerStartDraws = 10

type pod struct {
	row   int // 0-based row of the pod list
	name  string
	milli int64 // per GPU, as the published pod annotation (over 1000 read as 1000)
	total int64 // milli in all
}

func readCSV(path string) ([]map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return nil, err
	}
	var out []map[string]string
	for _, r := range rows[1:] {
		m := map[string]string{}
		for i, h := range rows[0] {
			m[h] = r[i]
		}
		out = append(out, m)
	}
	return out, nil
}

func atoi(s string) int64 {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		log.Fatalf("not an integer: %q", s)
	}
	return v
}

func main() {
	if len(os.Args) != 4 {
		log.Fatal("usage: published_draws PODS.csv NODES.csv SEED")
	}
	podRows, err := readCSV(os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	nodeRows, err := readCSV(os.Args[2])
	if err != nil {
		log.Fatal(err)
	}
	seed := atoi(os.Args[3])

	var pods []*pod
	for i, r := range podRows {
		gpus, milli := atoi(r["num_gpu"]), atoi(r["gpu_milli"])
		if gpus == 0 || milli < 0 {
			milli = 0
		} else if milli > 1000 {
			milli = 1000
		}
		pods = append(pods, &pod{i, r["name"], milli, milli * gpus})
	}
	var capacity int64
	type node struct {
		row  int
		name string
	}
	var nodes []node
	for i, r := range nodeRows {
		capacity += atoi(r["gpu"]) * 1000
		nodes = append(nodes, node{i, r["sn"]})
	}
	byName := func(s []*pod) {
		sort.Slice(s, func(i, j int) bool { return s[i].name < s[j].name })
	}
	workload := append([]*pod(nil), pods...)
	byName(workload)

	rand.Seed(seed)
	_ = rand.Int()
	list := append([]*pod(nil), pods...)
	byName(list)
	rand.Shuffle(len(list), func(i, j int) { list[i], list[j] = list[j], list[i] })
	var total int64
	for _, p := range list {
		total += p.total
	}
	target := tune * float64(capacity)
	if float64(total) > target {
		for float64(total) > target {
			k := rand.Intn(len(list))
			total -= list[k].total
			list = append(list[:k], list[k+1:]...)
		}
	} else if float64(total) < target {
		for {
			p := workload[rand.Intn(len(workload))]
			if float64(total+p.milli) > target {
				break
			}
			total += p.total
			list = append(list, p)
		}
	}
	for i := 0; i < schedulerStartDraws; i++ {
		rand.Float64()
	}
	sort.Slice(nodes, func(i, j int) bool { return nodes[i].name < nodes[j].name })
	perm := rand.Perm(len(nodes))
	rank := make([]int, len(nodes))
	for i, n := range nodes {
		rank[n.row] = perm[i]
	}
	rows := make([]int, len(list))
	for i, p := range list {
		rows[i] = p.row
	}
	out := map[string]interface{}{"seed": seed, "pods": rows, "rank": rank}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		log.Fatal(err)
	}
}
